"""The MoE shape of a checkpoint, and reading only some experts' weights from it.

An expert worker never builds the model: it reads config.json (the model class on the meta
device gives the MoE layer ids and expert sizes) and then, through `Checkpoint.iter_weights`
with a name filter, only the tensors of the (MoE layer, expert) pairs its replicas need.
Checkpoint names are parsed by `moemesh.engine.models.expert_names` (the parser the model
loader uses): per expert, gate -> w13[:I], up -> w13[I:], down -> w2; a fused 3-D tensor
(`...experts.gate_up_proj` [E, 2I, H], `...experts.down_proj` [E, H, I]) is read whole and the
wanted experts kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.loader.build import on_meta_without_init
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.loader.fp8_checkpoint import read_fp8_block, weight_name
from moemesh.engine.models import get_model_class
from moemesh.engine.models.expert_names import parse_expert_weight_name
from moemesh.kernels.fp8 import FP8_DTYPE, cdiv

LayerExpert = tuple[int, int]  # (MoE-layer ordinal, logical expert)
# w13 [2 * intermediate, hidden], w2 [hidden, intermediate]; block-FP8 checkpoints:
# (w13 float8, w13_scale_inv [2 * ceil(I / bn), ceil(H / bk)], w2 float8, w2_scale_inv [ceil(H / bn), ceil(I / bk)])
ExpertTensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class MoEShape:
    architecture: str
    moe_layer_ids: tuple[int, ...]  # model layer index of each MoE-layer ordinal
    num_experts: int
    hidden_size: int
    intermediate_size: int  # per routed expert
    fp8_block: tuple[int, int] | None = None  # (block_n, block_k) of a block-FP8 checkpoint

    @property
    def num_layers(self) -> int:
        return len(self.moe_layer_ids)


def read_moe_shape(checkpoint: Checkpoint) -> MoEShape:
    """Raises ModelLoadError when the checkpoint is not a MoE model."""
    cfg = TransformerConfig.from_hf(checkpoint.hf_config)
    with on_meta_without_init():
        model = get_model_class(cfg.architecture)(cfg)
    layer_ids = tuple(getattr(model, "moe_layer_ids", ()))
    if not layer_ids:
        raise ModelLoadError(f"{cfg.architecture} has no MoE layers: expert workers need a Mixture-of-Experts model")
    num_experts, rows, hidden = model.moe_layers()[0].experts.w13.shape
    fp8_block = read_fp8_block(checkpoint.hf_config)
    return MoEShape(cfg.architecture, layer_ids, int(num_experts), int(hidden), int(rows) // 2, fp8_block)


def read_expert_weights(
    checkpoint: Checkpoint, shape: MoEShape, wanted: set[LayerExpert], dtype: torch.dtype
) -> dict[LayerExpert, ExpertTensors]:
    """The weights of the wanted (MoE layer, expert) pairs, contiguous, in `dtype`."""
    ordinal = {layer: i for i, layer in enumerate(shape.moe_layer_ids)}
    wanted_layers = {layer for layer, _ in wanted}

    fp8_block = read_fp8_block(checkpoint.hf_config)  # block-FP8 checkpoint: experts stay float8

    def select(name: str) -> bool:
        parsed = parse_expert_weight_name(weight_name(name))  # a weight, or its `_scale_inv`
        if parsed is None:
            return False
        layer = ordinal.get(parsed.layer)
        return layer in wanted_layers if parsed.expert is None else (layer, parsed.expert) in wanted

    parts: dict[LayerExpert, dict[str, torch.Tensor]] = {key: {} for key in wanted}
    for name, tensor in checkpoint.iter_weights(select):
        parsed = parse_expert_weight_name(weight_name(name))
        layer = ordinal[parsed.layer]
        if parsed.expert is not None:
            parts[(layer, parsed.expert)][parsed.part + ("_scale" if name != weight_name(name) else "")] = tensor
            continue
        for key in wanted:
            if key[0] == layer:
                parts[key][parsed.part] = tensor[key[1]]
    weights = {}
    inter, hidden = shape.intermediate_size, shape.hidden_size
    for (layer, expert), found in sorted(parts.items()):
        where = f"expert {expert} of MoE layer {layer} (model layer {shape.moe_layer_ids[layer]})"
        if "gate_up" in found:
            w13 = found["gate_up"]
        elif "gate" in found and "up" in found:
            gate, up = found["gate"], found["up"]
            w13 = torch.cat((gate, up) if gate.dtype == up.dtype else (gate.float(), up.float()), dim=0)
        else:
            raise ModelLoadError(f"checkpoint lacks the gate/up projection of {where}")
        if "down" not in found:
            raise ModelLoadError(f"checkpoint lacks the down projection of {where}")
        w2 = found["down"]
        if tuple(w13.shape) != (2 * inter, hidden) or tuple(w2.shape) != (hidden, inter):
            raise ModelLoadError(
                f"{where} has shapes {tuple(w13.shape)}, {tuple(w2.shape)}; expected "
                f"{(2 * inter, hidden)}, {(hidden, inter)}"
            )
        if any(t.dtype == FP8_DTYPE for t in found.values()):
            if fp8_block is None:
                raise ModelLoadError(
                    f"{where} is float8_e4m3fn but config.json declares no block-FP8 quantization_config"
                )
            weights[(layer, expert)] = _fp8_expert(found, fp8_block, where)
        else:
            weights[(layer, expert)] = (w13.float().to(dtype).contiguous(), w2.float().to(dtype).contiguous())
    return weights


def _fp8_expert(found: dict[str, torch.Tensor], block: tuple[int, int], where: str) -> ExpertTensors:
    """(w13, w13_scale_inv, w2, w2_scale_inv) as stored: float8 weights, float32 scales (the
    gate's scale blocks, then the up's: `kernels.dispatch.fp8_fused_moe`'s layout)."""
    if "gate_up" in found:
        raise ModelLoadError(f"{where}: fused 3-D expert tensors are not supported in block-FP8 checkpoints")
    scales = {}
    for part in ("gate", "up", "down"):
        weight = found[part]
        scale = found.get(f"{part}_scale")
        if weight.dtype != FP8_DTYPE or scale is None:
            raise ModelLoadError(
                f"{where}: the {part} projection must be float8_e4m3fn with a weight_scale_inv "
                f"(got {weight.dtype}, scale_inv {'present' if scale is not None else 'missing'})"
            )
        expected = (cdiv(weight.shape[0], block[0]), cdiv(weight.shape[1], block[1]))
        if tuple(scale.shape) != expected or scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ModelLoadError(
                f"{where}: the {part} projection's weight_scale_inv is {scale.dtype} "
                f"{tuple(scale.shape)}; with weight_block_size {list(block)} it must be float32 "
                f"{expected}"
            )
        scales[part] = scale.float()
    w13 = torch.cat((found["gate"], found["up"]), dim=0)  # [2 * intermediate, hidden] float8
    w13_scale_inv = torch.cat((scales["gate"], scales["up"]), dim=0)  # [2 * ceil(I / bn), ceil(H / bk)]
    return w13, w13_scale_inv.contiguous(), found["down"].contiguous(), scales["down"].contiguous()
