"""The MoE shape of a checkpoint, and reading only some experts' weights from it.

An expert worker never builds the model: it reads config.json (the model class on the meta
device gives the MoE layer ids and expert sizes) and then, through `Checkpoint.iter_weights`
with a name filter, only the tensors of the (MoE layer, expert) pairs its replicas need.
Checkpoint names (the ones MoEForCausalLM.load_weights accepts):
- per expert: `model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{gate_proj|w1}.weight` ->
  w13[:I], `{up_proj|w3}` -> w13[I:], `{down_proj|w2}` -> w2;
- fused 3-D: `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H], `...down_proj` [E, H, I]
  (the whole tensor is read, the wanted experts kept).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.models import get_model_class
from moemesh.engine.models.config import TransformerConfig

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}

LayerExpert = tuple[int, int]  # (MoE-layer ordinal, logical expert)
ExpertTensors = tuple[torch.Tensor, torch.Tensor]  # w13 [2 * intermediate, hidden], w2 [hidden, intermediate]


@dataclass(frozen=True)
class MoEShape:
    architecture: str
    moe_layer_ids: tuple[int, ...]  # model layer index of each MoE-layer ordinal
    num_experts: int
    hidden_size: int
    intermediate_size: int  # per routed expert

    @property
    def num_layers(self) -> int:
        return len(self.moe_layer_ids)


def read_moe_shape(checkpoint: Checkpoint) -> MoEShape:
    """Raises ModelLoadError when the checkpoint is not a MoE model."""
    cfg = TransformerConfig.from_hf(checkpoint.hf_config)
    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg)
    layer_ids = tuple(getattr(model, "moe_layer_ids", ()))
    if not layer_ids:
        raise ModelLoadError(f"{cfg.architecture} has no MoE layers: expert workers need a Mixture-of-Experts model")
    num_experts, rows, hidden = model.moe_layers()[0].experts.w13.shape
    return MoEShape(cfg.architecture, layer_ids, int(num_experts), int(hidden), int(rows) // 2)


def read_expert_weights(
    checkpoint: Checkpoint, shape: MoEShape, wanted: set[LayerExpert], dtype: torch.dtype
) -> dict[LayerExpert, ExpertTensors]:
    """The weights of the wanted (MoE layer, expert) pairs, contiguous, in `dtype`."""
    ordinal = {layer: i for i, layer in enumerate(shape.moe_layer_ids)}
    wanted_layers = {layer for layer, _ in wanted}

    def select(name: str) -> bool:
        if m := _PER_EXPERT.match(name):
            return (ordinal.get(int(m.group(1))), int(m.group(2))) in wanted
        m = _FUSED.match(name)
        return m is not None and ordinal.get(int(m.group(1))) in wanted_layers

    parts: dict[LayerExpert, dict[str, torch.Tensor]] = {key: {} for key in wanted}
    for name, tensor in checkpoint.iter_weights(select):
        if m := _PER_EXPERT.match(name):
            parts[(ordinal[int(m.group(1))], int(m.group(2)))][_PART[m.group(3)]] = tensor
            continue
        m = _FUSED.match(name)
        layer = ordinal[int(m.group(1))]
        for key in wanted:
            if key[0] == layer:
                parts[key]["gate_up" if m.group(2) == "gate_up_proj" else "down"] = tensor[key[1]]
    weights = {}
    inter, hidden = shape.intermediate_size, shape.hidden_size
    for (layer, expert), found in sorted(parts.items()):
        where = f"expert {expert} of MoE layer {layer} (model layer {shape.moe_layer_ids[layer]})"
        if "gate_up" in found:
            w13 = found["gate_up"]
        elif "gate" in found and "up" in found:
            w13 = torch.cat((found["gate"], found["up"]), dim=0)
        else:
            raise ModelLoadError(f"checkpoint lacks the gate/up projection of {where}")
        if "down" not in found:
            raise ModelLoadError(f"checkpoint lacks the down projection of {where}")
        w2 = found["down"]
        if tuple(w13.shape) != (2 * inter, hidden) or tuple(w2.shape) != (hidden, inter):
            raise ModelLoadError(f"{where} has shapes {tuple(w13.shape)}, {tuple(w2.shape)}; expected "
                                 f"{(2 * inter, hidden)}, {(hidden, inter)}")  # fmt: skip
        weights[(layer, expert)] = (w13.float().to(dtype).contiguous(), w2.float().to(dtype).contiguous())
    return weights
