from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from moemesh.engine.layers.group_quantized import GroupQuantized
from moemesh.text.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    hf_config: dict  # Hugging Face config.json fields
    tokenizer: Tokenizer
    # HF names, float32/bf16 tensors; iter_weights(select) reads only names with select(name) true
    iter_weights: Callable[..., Iterator[tuple[str, torch.Tensor]]]
    num_tensors: int
    model_id: str  # identifies the weights in prefix-cache keys
    # GGUF: HF name -> block type of each tensor that can stay quantized (loader/gguf_blocks.py);
    # read_quantized(names) yields (name, GroupQuantized) for those names without dequantizing
    quantized: dict[str, str] = field(default_factory=dict)
    read_quantized: Callable[..., Iterator[tuple[str, GroupQuantized]]] | None = None
