"""Helpers of the Hugging Face oracle tests: an engine's logits of every position of one
sequence (prefill, then one decode step, through the model with a hand-made block table), and
the relative error the oracle tests bound."""

from __future__ import annotations

import torch

from moemesh import LLM
from moemesh.engine.layers.attention_metadata import AttentionMetadata


def prefill_then_decode_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """Logits of every position: prefill all but the last token, then the last one as a decode
    step, written straight through the model into blocks 1..n of its KV cache."""
    model, block_size = llm.engine.model, llm.engine.budget.block_size
    table = torch.arange(1, -(-len(ids) // block_size) + 1, dtype=torch.int32)[None]  # [1, num_blocks]
    positions = torch.arange(len(ids))  # [num_tokens]
    slots = table[0, positions // block_size].long() * block_size + positions % block_size  # [num_tokens]
    n = len(ids) - 1
    prefill = AttentionMetadata(slots[:n], torch.tensor([0, n], dtype=torch.int32),
                                torch.tensor([n], dtype=torch.int32), table, 0)  # fmt: skip
    decode = AttentionMetadata(slots[n:], torch.tensor([0, 1], dtype=torch.int32),
                               torch.tensor([n + 1], dtype=torch.int32), table, 1)  # fmt: skip
    with torch.inference_mode():
        first = model.compute_logits(model(torch.tensor(ids[:n]), positions[:n], prefill))  # [n, vocab]
        last = model.compute_logits(model(torch.tensor(ids[n:]), positions[n:], decode))  # [1, vocab]
    return torch.cat((first, last))


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-position max |ours - ref| relative to that position's largest |ref| logit."""
    return ((ours.float() - ref.float()).abs().max(dim=-1).values / ref.float().abs().max(dim=-1).values).max().item()
