"""The per-round description of the flattened varlen batch that attention layers read, and what
its layers derive from it once per round (the decode plan, RoPE's cos/sin of the positions)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moemesh.kernels.paged_attention import DecodePlan


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32, query token offsets per request
    context_lens: torch.Tensor  # [num_reqs] int32, cached + new tokens per request
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32, padded with the null block
    num_decode_reqs: int  # the first num_decode_reqs requests have exactly one query token
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # filled by the first layer

    def decode_plan(self, block_size: int) -> DecodePlan:
        """The all-decode round's block tables and mask, built by its first attention layer."""
        if "decode_plan" not in self.derived:
            self.derived["decode_plan"] = DecodePlan(self.block_tables, self.context_lens, block_size)
        return self.derived["decode_plan"]

    def rope_cos_sin(self, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """cos_sin_cache[positions], gathered once per round per table (the layers share one)."""
        key = ("rope", id(cos_sin_cache))
        if key not in self.derived:
            self.derived[key] = cos_sin_cache[positions]  # [num_tokens, rotary_dim]
        return self.derived[key]
