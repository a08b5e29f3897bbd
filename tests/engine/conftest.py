"""The SmolLM2 oracle prompts and Hugging Face's greedy continuations of them, computed once per
session for every oracle module (dense float32 and quantized)."""

from __future__ import annotations

import pytest
import torch

from .oracle_helpers import CHAT, MAX_NEW, PROMPTS


@pytest.fixture(scope="session")
def prompt_ids(hf_tokenizer):
    ids = [hf_tokenizer(p).input_ids for p in PROMPTS]
    chat = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    return ids + [list(chat)]


@pytest.fixture(scope="session")
def hf_greedy(hf_model, prompt_ids):
    """One prompt at a time (no padding): the plain oracle."""
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            outputs.append(out[0, len(ids) :].tolist())
    return outputs
