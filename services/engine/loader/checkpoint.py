from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moemesh.text.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    hf_config: dict  # Hugging Face config.json fields
    tokenizer: Tokenizer
    # HF names, float32/bf16 tensors; iter_weights(select) reads only names with select(name) true
    iter_weights: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    num_tensors: int
    model_id: str  # identifies the weights in prefix-cache keys
