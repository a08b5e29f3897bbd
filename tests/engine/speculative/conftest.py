"""Draft models for speculation tests: tiny random Llamas with SmolLM2's vocabulary (so they can
draft for it, and mostly get rejected), saved with transformers' `save_pretrained`."""

from __future__ import annotations

import pytest

SMOLLM_VOCAB = 49152


def save_tiny_llama(path: str, vocab_size: int = SMOLLM_VOCAB, num_layers: int = 2, seed: int = 0):
    """A random Llama (hidden 64) saved to `path`; returns the HF model (the oracle)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """(path, HF model) of a random 2-layer Llama with SmolLM2's vocabulary."""
    path = str(tmp_path_factory.mktemp("tiny_draft"))
    return path, save_tiny_llama(path)
