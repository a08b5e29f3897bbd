"""Keep a GGUF file's quantized tensors quantized (layers/quantized_linear.py).

`plan_gguf` runs on the model built on the meta device, from tensor names and types only: every
projection inside `model.layers` whose checkpoint tensors are all of one quantized type (a merged
q/k/v or gate/up needs all its parts, of the same type) becomes a `QuantizedLinear`; a quantized
token embedding becomes a `QuantizedEmbedding` (a tied lm_head multiplies through it); a separate
quantized lm_head becomes a `QuantizedLinear`. The tensors it takes are left out of the
dequantizing stream (`owns`); `load` then reads them as codes + scales and merges parts by rows
(concatenated once here, so q/k/v and gate/up stay one matmul each). Everything else (norms, F32 /
F16 tensors, mixed-type merges) loads dequantized as before; a mixed-type merge is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.group_quantized import GroupQuantized, concat_rows
from moemesh.engine.layers.quantized_linear import QuantizedEmbedding, QuantizedLinear
from moemesh.engine.loader.checkpoint import Checkpoint

log = logging.getLogger(__name__)
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def keeps_quantized(checkpoint: Checkpoint, quantization: str, dtype: str, device: str) -> bool:
    """ModelConfig.quantization resolved for this checkpoint, dtype and device (logged)."""
    if not checkpoint.quantized or quantization == "none":
        return False
    if torch.device(device).type != "cpu":
        log.info("GGUF weights dequantized to %s at load: quantized layers run on CPU only", dtype)
        return False
    if quantization == "auto" and dtype == "float32" and not kernels.quantized_kernels_built():
        log.info(
            "GGUF weights dequantized to float32 at load: no C compiler for the quantized float32 kernels "
            "(quantization='gguf' keeps them quantized, dequantizing per call with torch)"
        )
        return False
    if quantization == "auto" and dtype not in ("bfloat16", "float32"):
        log.info(
            "GGUF weights dequantized to %s at load: the quantized CPU kernels serve bfloat16 and float32 "
            "(quantization='gguf' keeps them quantized, dequantizing per call)",
            dtype,
        )
        return False
    types = sorted(set(checkpoint.quantized.values()))
    log.info("GGUF weights stay quantized (%s) with %s activations", ", ".join(types), dtype)
    return True


class GgufPlan:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.targets: dict[str, tuple[QuantizedLinear, int, int]] = {}  # tensor -> (module, part, num_parts)
        self.gathered: set[QuantizedLinear] = set()  # embedding tables (rows are gathered)

    def owns(self, name: str) -> bool:
        return name in self.targets

    def load(self, checkpoint: Checkpoint) -> None:
        pending: dict[QuantizedLinear, dict[int, GroupQuantized]] = {}
        for name, weight in checkpoint.read_quantized(list(self.targets)):
            module, part, num_parts = self.targets[name]
            parts = pending.setdefault(module, {})
            parts[part] = weight
            if len(parts) == num_parts:
                merged = concat_rows([parts[i] for i in range(num_parts)]) if num_parts > 1 else weight
                module.load(merged, self.dtype, gather=module in self.gathered)
                del pending[module]
        assert not pending, "every part of a merged projection was read"


def plan_gguf(
    model: nn.Module, checkpoint: Checkpoint, select: Callable[[str], bool] | None, dtype: torch.dtype
) -> GgufPlan:
    plan = GgufPlan(dtype)
    quantized = {n: t for n, t in checkpoint.quantized.items() if select is None or select(n)}
    if EMBED in quantized and isinstance(getattr(model.model, "embed_tokens", None), nn.Embedding):
        old = model.model.embed_tokens
        model.model.embed_tokens = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, dtype)
        plan.targets[EMBED] = (model.model.embed_tokens.table, 0, 1)
        plan.gathered.add(model.model.embed_tokens.table)
    if LM_HEAD in quantized and isinstance(getattr(model, "lm_head", None), nn.Linear):
        model.lm_head = QuantizedLinear.like(model.lm_head)
        plan.targets[LM_HEAD] = (model.lm_head, 0, 1)
    stacked: dict[str, tuple[str, int]] = getattr(model, "stacked_params", {})
    merged: dict[str, dict[int, str]] = {}  # module path -> {part: tensor name}
    for name in quantized:
        if not name.startswith("model.layers.") or not name.endswith(".weight"):
            continue
        fragment = next((f for f in stacked if f in name), None)
        local, part = name, 0
        if fragment is not None:
            target, part = stacked[fragment]
            local = name.replace(fragment, target)
        merged.setdefault(local[: -len(".weight")], {})[part] = name
    for path, parts in merged.items():
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            continue
        num_parts = sum(merged_name in path + "." for merged_name, _ in stacked.values()) or 1
        types = {quantized[n] for n in parts.values()}
        if len(parts) != num_parts or len(types) != 1:
            log.info(
                "%s: parts %s of types %s stay dequantized (a merged projection needs every part in one "
                "quantized type)",
                path,
                sorted(parts),
                sorted(types),
            )
            continue
        module = QuantizedLinear.like(linear)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
        for part, name in parts.items():
            plan.targets[name] = (module, part, num_parts)
    return plan
