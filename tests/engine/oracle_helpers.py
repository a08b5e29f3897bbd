"""Helpers of the Hugging Face oracle tests: the SmolLM2 oracle prompts, an engine's logits of
every position of one sequence (prefill, then one decode step, through the model with a
hand-made block table), and the relative error the oracle tests bound."""

from __future__ import annotations

import torch

from moemesh import LLM, SamplingParams
from moemesh.engine.layers.attention_metadata import AttentionMetadata

MAX_NEW = 24
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4,",
    "Über café naïve — 日本語のテスト",
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island far from the "
    "coast. Every night he climbed the stairs, lit the lamp, and watched the ships pass. One winter",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The three primary colors are",
]
CHAT = [{"role": "user", "content": "Name two planets of the solar system."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def prefill_then_decode_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """Logits of every position: prefill all but the last token, then the last one as a decode
    step, written straight through the model into blocks 1..n of its KV cache."""
    model, block_size = llm.engine.model, llm.engine.budget.block_size
    table = torch.arange(1, -(-len(ids) // block_size) + 1, dtype=torch.int32)[None]  # [1, num_blocks]
    positions = torch.arange(len(ids))  # [num_tokens]
    slots = table[0, positions // block_size].long() * block_size + positions % block_size  # [num_tokens]
    n = len(ids) - 1
    prefill = AttentionMetadata(
        slots[:n], torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), table, 0
    )
    decode = AttentionMetadata(
        slots[n:], torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n + 1], dtype=torch.int32), table, 1
    )
    with torch.inference_mode():
        first = model.compute_logits(model(torch.tensor(ids[:n]), positions[:n], prefill))  # [n, vocab]
        last = model.compute_logits(model(torch.tensor(ids[n:]), positions[n:], decode))  # [1, vocab]
    return torch.cat((first, last))


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-position max |ours - ref| relative to that position's largest |ref| logit."""
    return ((ours.float() - ref.float()).abs().max(dim=-1).values / ref.float().abs().max(dim=-1).values).max().item()


def prefill_logits(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:  # [len(seq), vocab] each
    """Logits of every position of every sequence from one varlen prefill round (teacher forcing:
    if the argmax at each position is the next token of `seq`, greedy decoding from the prompt
    reproduces `seq`)."""
    model, block_size = llm.engine.model, llm.engine.budget.block_size
    lens = [len(s) for s in sequences]
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(sequences), max(blocks), dtype=torch.int32)  # [num_reqs, max_num_blocks]
    first = 1
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(first, first + b, dtype=torch.int32)
        first += b
    positions = torch.cat([torch.arange(n) for n in lens])  # [num_tokens]
    rows = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor(lens))
    slots = table[rows, positions // block_size].long() * block_size + positions % block_size  # [num_tokens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(slots, cu, torch.tensor(lens, dtype=torch.int32), table, 0)
    ids = torch.tensor([t for s in sequences for t in s])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, meta)).float()  # [num_tokens, vocab]
    return list(logits.split(lens))
