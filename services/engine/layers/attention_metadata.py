"""The per-round description of the flattened varlen batch that attention layers read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] int32, query token offsets per request
    context_lens: torch.Tensor  # [num_reqs] int32, cached + new tokens per request
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32, padded with the null block
    num_decode_reqs: int  # the first num_decode_reqs requests have exactly one query token
