"""The one parser of routed-expert checkpoint tensor names, for the model loader and the expert
worker (which reads only some experts' tensors).

- per expert (what transformers 5.24 `save_pretrained` writes, and the released checkpoints):
  `model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{gate_proj|w1|up_proj|w3|down_proj|w2}.weight`;
- fused 3-D (transformers' in-memory layout): `model.layers.{i}.{mlp|block_sparse_moe}.experts.gate_up_proj`
  [E, 2I, H] and `...experts.down_proj` [E, H, I].
Shared experts (`shared_experts.*`, `shared_expert.*`) and the router (`gate.weight`) are not
routed-expert weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(
    r"^(?P<prefix>model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)\."
    r"(?:(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight|(?P<fused>gate_up_proj|down_proj))$"
)
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class ExpertWeightName:
    prefix: str  # e.g. "model.layers.3.mlp.experts": the RoutedExperts module's name (before renames)
    layer: int  # model layer index (not the MoE-layer ordinal)
    expert: int | None  # None: a fused tensor of all the layer's experts
    part: str  # "gate" | "up" | "down" (per expert), "gate_up" | "down" (fused)


def parse_expert_weight_name(name: str) -> ExpertWeightName | None:
    """None for every tensor that is not a routed expert's."""
    m = _NAME.match(name)
    if m is None:
        return None
    if m["fused"] is not None:
        return ExpertWeightName(
            m["prefix"], int(m["layer"]), None, "gate_up" if m["fused"] == "gate_up_proj" else "down"
        )
    return ExpertWeightName(m["prefix"], int(m["layer"]), int(m["expert"]), _PART[m["proj"]])


def is_routed_expert_weight(name: str) -> bool:
    return parse_expert_weight_name(name) is not None
