"""Rotary embedding: one float32 cos/sin table per shape, shared by the layers, with the checkpoint's scaling baked in
(layers/rope_scaling.py: frequencies, and YaRN's cos/sin attention factor)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.rope_scaling import RopeScaling


def rope_inv_freq(rotary_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:  # [rotary_dim / 2]
    if scaling is None:
        return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return scaling.inv_freq(rotary_dim, base)


@functools.lru_cache(maxsize=8)
def cos_sin_table(
    rotary_dim: int, max_position: int, base: float, scaling: RopeScaling | None
) -> torch.Tensor:  # [max_position, rotary_dim] float32
    """On the CPU, once per shape, shared by every layer (read-only): 30 float64 tables of 8k
    positions were two seconds of each model load."""
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
    factor = 1.0 if scaling is None else scaling.cos_sin_factor()
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * factor).float()


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: RopeScaling | None = None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        if torch.get_default_device().type == "meta":  # built on meta: the loader rebuilds the table
            cache = torch.empty(max_position, rotary_dim)
        else:
            cache = cos_sin_table(rotary_dim, max_position, float(base), scaling)  # [max_position, rotary_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.is_neox_style = is_neox_style

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor | None = None):
        """`cos_sin`: cos_sin_cache[positions] if the caller has it (AttentionMetadata.rope_cos_sin)."""
        return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox_style, cos_sin)
