"""Rotary embedding with the checkpoint's scaling (none, linear, llama3, yarn-free subset)."""

from __future__ import annotations

import math

import torch
from torch import nn

from moemesh import kernels


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None = None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        inv_freq = rope_inv_freq(rotary_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()  # [max_position, rotary_dim]
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.is_neox_style = is_neox_style

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox_style)
