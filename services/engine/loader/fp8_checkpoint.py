"""Block-FP8 checkpoints in the DeepSeek-V3 format, loaded without upcasting the model.

config.json: `quantization_config = {quant_method: "fp8", fmt: "e4m3", activation_scheme:
"dynamic", weight_block_size: [block_n, block_k]}`. A quantized Linear `X` is stored as
`X.weight` float8_e4m3fn [N, K] plus `X.weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)]
(kernels/fp8.py has the math). Which tensors are quantized is read from the checkpoint: those
with a `_scale_inv` (DeepSeek-V3: every Linear in the decoder layers, routed and shared experts
included; embeddings, norms, the router and lm_head are bf16).

Loading (`Fp8Plan`, used by loader/build.py):
1. `plan_fp8` runs on the model built on the meta device, from the checkpoint's tensor names
   only (no shard is opened for it): an nn.Linear inside `model.layers` whose checkpoint weight
   has a scale is replaced by a `layers.fp8_linear.Fp8Linear` (merged Linears, e.g.
   gate_up_proj, get one part per checkpoint tensor), and a `RoutedExperts` with scales switches
   to FP8 storage (`use_fp8`). Every other scaled tensor is dequantized as it is read, to the
   model dtype: MLA's kv_b_proj (the attention reads its weight as a matrix), and anything that
   is not a Linear in a decoder layer. A plan without a model (`Fp8Plan(names, block)`)
   dequantizes every scaled tensor (a model whose names it cannot map, e.g. the MTP drafter).
2. `Fp8Plan.stream` sits between `Checkpoint.iter_weights` and `model.load_weights`: FP8
   weights and Fp8Linear scales pass through as stored (the model's loader merges and copies
   them; float8 -> float8 copies), routed-expert scales are written into the experts' buffers,
   the rest is upcast to float32 per tensor as before. `finish()` then checks every expert has
   all its scales.
3. `cast_floating` converts the materialized model to its dtype, leaving float8 weights and
   float32 `*_scale_inv` as they are.

Bad checkpoints raise ModelLoadError naming the tensor: a float8 weight without its
`_scale_inv`, a scale of the wrong shape or dtype, a scaled weight that is not float8_e4m3fn, an
unsupported `quantization_config` or block size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.layers.fp8_linear import Fp8Linear
from moemesh.engine.layers.moe import RoutedExperts
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.models.expert_names import parse_expert_weight_name
from moemesh.kernels.fp8 import FP8_DTYPE, block_dequant_ref, cdiv

SCALE_SUFFIX = "_scale_inv"
_FLOAT8_DTYPES = tuple(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))
_DEQUANTIZED_AT_LOAD = (".kv_b_proj",)  # Linears whose `.weight` the model reads as a dense matrix (MLA)
Tensors = Iterable[tuple[str, torch.Tensor]]


def weight_name(name: str) -> str:
    """The weight a tensor belongs to: `X.weight_scale_inv` -> `X.weight`; other names unchanged."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name


def read_fp8_block(hf_config: dict) -> tuple[int, int] | None:
    """(block_n, block_k) of a block-FP8 checkpoint, None when config.json declares no quantization."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    where = "config.json quantization_config"
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(
            f"{where}: quant_method {method!r} is not supported (moemesh loads 'fp8', "
            f"block-scaled e4m3 as in DeepSeek-V3)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{where}: fmt {qc['fmt']!r} is not supported (only 'e4m3')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(
            f"{where}: activation_scheme {qc['activation_scheme']!r} is not supported "
            f"(only 'dynamic': activations are quantized per token at run time)"
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise ModelLoadError(
            f"{where}: weight_block_size is missing (per-tensor FP8 is not supported; "
            f"block-scaled checkpoints give [block_n, block_k], e.g. [128, 128])"
        )
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        or block[1] < 16
        or block[1] & (block[1] - 1)
    ):
        raise ModelLoadError(
            f"{where}: weight_block_size {block!r} is not supported: it must be "
            f"[block_n, block_k], positive, block_k a power of two >= 16 (e.g. [128, 128])"
        )
    return int(block[0]), int(block[1])


def tensor_names(checkpoint: Checkpoint) -> list[str]:
    """Every tensor name, read nothing: `iter_weights` asks `select` about each name and reads
    only those it accepts (an indexed directory opens no shard for this)."""
    names: list[str] = []

    def record(name: str) -> bool:
        names.append(name)
        return False

    for _ in checkpoint.iter_weights(record):
        pass
    return names


@dataclass(frozen=True)
class _LinearPart:
    module: Fp8Linear
    part: int  # which of module.output_sizes


@dataclass(frozen=True)
class _ExpertPart:
    prefix: str  # the RoutedExperts' name, after renames
    module: RoutedExperts
    expert: int
    part: str  # "gate" | "up" | "down"


class Fp8Plan:
    def __init__(
        self,
        names: Iterable[str],  # the checkpoint tensors the model reads
        block: tuple[int, int],
        skip: Callable[[str], bool] | None = None,  # the model's skip_weight: such tensors pass through as stored
        renames: dict[str, str] | None = None,  # the model's checkpoint-name renames
    ):
        self.block = block
        self.names = set(names)
        self.skip, self.renames = skip, renames or {}
        self.fp8_experts: dict[str, RoutedExperts] = {}  # renamed `...experts` prefix -> block-FP8 experts
        self.targets: dict[str, _LinearPart | _ExpertPart] = {}  # checkpoint weight name -> where it goes
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # dequantized at load: weight name -> parts
        self._expert_scales: dict[str, set[tuple[int, str]]] = {}  # prefix -> written (expert, part)

    # -- the stream ------------------------------------------------------------------------
    def stream(self, weights: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            base = weight_name(name)
            if self.skip is not None and self.skip(base):
                yield name, tensor  # the model drops it
            elif name.endswith(SCALE_SUFFIX):
                yield from self._scale(name, base, tensor)
            elif base + SCALE_SUFFIX in self.names:
                yield from self._quantized_weight(name, tensor)
            elif tensor.dtype in _FLOAT8_DTYPES:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} is {tensor.dtype} but the checkpoint has no "
                    f"{name + SCALE_SUFFIX!r} to scale it"
                )
            else:
                target = self._fp8_module_of(name)
                if target is not None:
                    raise ModelLoadError(
                        f"checkpoint tensor {name!r} is {tensor.dtype} without "
                        f"{name + SCALE_SUFFIX!r}, but {target} holds block-FP8 weights"
                    )
                yield name, tensor.float()

    def finish(self) -> None:
        """After the stream: every block-FP8 expert got its three scales, every pair was complete."""
        for prefix, experts in self.fp8_experts.items():
            need = {(e, p) for e in range(experts.w13.shape[0]) for p in ("gate", "up", "down")}
            missing = need - self._expert_scales[prefix]
            if missing:
                expert, part = min(missing)
                raise ModelLoadError(
                    f"checkpoint lacks {f'{prefix}.{expert}.{part}_proj.weight{SCALE_SUFFIX}'!r} "
                    f"({len(missing)} routed-expert scale(s) missing)"
                )
        for name, parts in self._pending.items():
            missing = name + SCALE_SUFFIX if "weight" in parts else name
            raise ModelLoadError(
                f"checkpoint lacks {missing!r} (its {'weight' if 'scale' in parts else 'scale'} is there)"
            )

    def _quantized_weight(self, name: str, tensor: torch.Tensor):
        if tensor.dtype != FP8_DTYPE:
            raise ModelLoadError(f"checkpoint tensor {name!r} has a scale_inv but is {tensor.dtype}, not float8_e4m3fn")
        if name in self.targets:
            yield name, tensor  # float8 as stored: the model's loader copies it into the FP8 module
        else:
            yield from self._pair(name, "weight", tensor)

    def _scale(self, name: str, base: str, tensor: torch.Tensor):
        if not tensor.is_floating_point() or tensor.dtype in _FLOAT8_DTYPES:
            raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}; a scale_inv must be float32")
        tensor = tensor.float()
        target = self.targets.get(base)
        if target is None:
            yield from self._pair(base, "scale", tensor)
            return
        expected = self._scale_shape(target)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; with "
                f"weight_block_size {list(self.block)} it must be {expected}"
            )
        if isinstance(target, _LinearPart):
            yield name, tensor  # merged with its sibling parts' scales by the model's loader
            return
        experts, half = target.module, cdiv(target.module.w13.shape[1] // 2, self.block[0])
        with torch.no_grad():
            if target.part == "down":
                experts.w2_scale_inv[target.expert].copy_(tensor)
            else:
                start = 0 if target.part == "gate" else half
                experts.w13_scale_inv[target.expert, start : start + half].copy_(tensor)
        self._expert_scales[target.prefix].add((target.expert, target.part))

    def _pair(self, name: str, kind: str, tensor: torch.Tensor):
        parts = self._pending.setdefault(name, {})
        parts[kind] = tensor
        if len(parts) < 2:
            return
        del self._pending[name]
        try:
            yield name, block_dequant_ref(parts["weight"], parts["scale"], self.block)  # float32
        except ValueError as e:
            raise ModelLoadError(
                f"checkpoint tensor {name + SCALE_SUFFIX!r} does not fit {name!r} "
                f"{tuple(parts['weight'].shape)} with weight_block_size {list(self.block)}: {e}"
            ) from e

    def _scale_shape(self, target: _LinearPart | _ExpertPart) -> tuple[int, int]:
        block_n, block_k = self.block
        if isinstance(target, _LinearPart):
            module = target.module
            return cdiv(module.output_sizes[target.part], block_n), cdiv(module.in_features, block_k)
        _, rows, hidden = target.module.w13.shape
        inter = rows // 2
        if target.part == "down":
            return cdiv(hidden, block_n), cdiv(inter, block_k)
        return cdiv(inter, block_n), cdiv(hidden, block_k)

    def _fp8_module_of(self, name: str) -> str | None:
        """For an unscaled tensor: the block-FP8 experts it would be copied into, if any."""
        parsed = parse_expert_weight_name(_renamed(name, self.renames))
        if parsed is None or parsed.prefix not in self.fp8_experts:
            return None
        return f"{parsed.prefix} (routed experts)"


def plan_fp8(model: nn.Module, names: Iterable[str], block: tuple[int, int]) -> Fp8Plan:
    """Swap FP8 modules into `model` (built on the meta device) for the scaled tensors among
    `names` (the tensors the model will read), and return the plan that loads them."""
    renames: dict[str, str] = getattr(model, "renames", {})
    plan = Fp8Plan(names, block, getattr(model, "skip_weight", None), renames)
    stacked: dict[str, tuple[str, int]] = getattr(model, "stacked_params", {})
    linear_parts: dict[str, dict[int, str]] = {}  # merged module path -> {part: checkpoint weight name}
    for scale_name in sorted(n for n in plan.names if n.endswith(SCALE_SUFFIX)):
        name = weight_name(scale_name)
        if plan.skip is not None and plan.skip(name):
            continue
        if not name.endswith(".weight"):
            raise ModelLoadError(f"checkpoint tensor {scale_name!r}: scales are supported for `.weight` tensors only")
        local = _renamed(name, renames)
        parsed = parse_expert_weight_name(local)
        if parsed is not None:
            experts = _submodule(model, parsed.prefix)
            if isinstance(experts, RoutedExperts) and experts.w13.shape[0] > 0:
                plan.targets[name] = _ExpertPart(parsed.prefix, experts, parsed.expert, parsed.part)
                plan.fp8_experts[parsed.prefix] = experts
            continue
        fragment = next((f for f in stacked if f in local), None)
        part = 0
        if fragment is not None:
            merged, part = stacked[fragment]
            local = local.replace(fragment, merged)
        path = local[: -len(".weight")]
        module = _submodule(model, path)
        if (
            isinstance(module, nn.Linear)
            and path.startswith("model.layers.")
            and not path.endswith(_DEQUANTIZED_AT_LOAD)
        ):
            linear_parts.setdefault(path, {})[part] = name
    for path, parts in linear_parts.items():
        linear = model.get_submodule(path)
        sizes = _part_sizes(model, path, linear)
        if len(parts) != len(sizes):
            present = next(iter(parts.values()))
            raise ModelLoadError(
                f"checkpoint has {present + SCALE_SUFFIX!r} but not the scale_inv of every part "
                f"merged into {path} ({len(parts)} of {len(sizes)}): all or none must be FP8"
            )
        fp8 = Fp8Linear.like(linear, sizes, block)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, fp8)
        for part, name in parts.items():
            plan.targets[name] = _LinearPart(fp8, part)
    for prefix, experts in plan.fp8_experts.items():
        experts.use_fp8(block)
        plan._expert_scales[prefix] = set()
    return plan


def _renamed(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _part_sizes(model: nn.Module, path: str, linear: nn.Linear) -> tuple[int, ...]:
    """Rows of each checkpoint tensor merged into `linear` (a plain Linear: one part)."""
    parts = [part for merged, part in getattr(model, "stacked_params", {}).values() if merged in path + "."]
    if not parts:
        return (linear.out_features,)
    num_parts = 1 + max(parts)
    parent = model.get_submodule(path.rpartition(".")[0])
    if num_parts == 3 and hasattr(parent, "q_size") and hasattr(parent, "kv_size"):  # qkv_proj (GQA)
        return (parent.q_size, parent.kv_size, parent.kv_size)
    assert linear.out_features % num_parts == 0, (path, linear.out_features, num_parts)
    return (linear.out_features // num_parts,) * num_parts


def loaded_tensors(weights: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """An unquantized checkpoint: every tensor upcast to float32 (the model casts afterwards)."""
    for name, tensor in weights:
        if tensor.dtype in _FLOAT8_DTYPES:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} is {tensor.dtype} but config.json declares no "
                f"quantization_config (block-FP8 needs quant_method 'fp8' and weight_block_size)"
            )
        yield name, tensor.float()


def cast_floating(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype) for every floating parameter and buffer except float8 weights and their
    float32 `*_scale_inv` (which `Module.to` would convert too: float8 counts as floating), and
    the buffers of modules that keep their own storage dtypes (GGUF quantized layers)."""
    for module in model.modules():
        if getattr(module, "keeps_storage_dtypes", False):
            continue
        for name, param in module.named_parameters(recurse=False):
            if _converts(name, param, dtype):
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if _converts(name, buffer, dtype):
                setattr(module, name, buffer.to(dtype))
    return model


def _converts(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        tensor.is_floating_point()
        and tensor.dtype != dtype
        and tensor.dtype not in _FLOAT8_DTYPES
        and not name.endswith(SCALE_SUFFIX)
    )
