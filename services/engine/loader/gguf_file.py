"""GGUF (llama.cpp) checkpoints: map tensor names and metadata onto the Hugging Face Llama layout.
`iter_weights` dequantizes (any type `gguf` knows) to float32, with gguf's own bits (the types
of gguf_blocks through it: faster); `read_quantized` gives the 2-D
tensors of the types in gguf_blocks.QUANTIZED_TYPES as codes + scales, never dequantized (the
loader keeps them so: loader/gguf_quant.py).

llama.cpp stores attn_q/attn_k rows permuted for its interleaved RoPE; we undo that so the
weights match HF's rotate-half RoPE.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.loader.gguf_blocks import QUANTIZED_TYPES, read_blocks
from moemesh.text.gguf_metadata import open_reader
from moemesh.text.model_text import gguf_model_text

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str) -> Checkpoint:
    reader = open_reader(path)
    text = gguf_model_text(reader, path)
    num_heads, num_kv_heads = text.hf_config["num_attention_heads"], text.hf_config["num_key_value_heads"]

    def iter_weights(select=None):
        for tensor in reader.tensors:
            name = _hf_name(tensor.name)
            if name is None or (select is not None and not select(name)):
                continue
            array = _dequantize(tensor)
            if tensor.name.endswith("attn_q.weight"):
                array = _unpermute(array, num_heads)
            elif tensor.name.endswith("attn_k.weight"):
                array = _unpermute(array, num_kv_heads)
            if not array.flags.writeable:  # F32 tensors are read-only views of the mmap
                array = array.copy()
            yield name, torch.from_numpy(np.ascontiguousarray(array))

    by_name = {_hf_name(t.name): t for t in reader.tensors if _hf_name(t.name) is not None}
    quantized = {
        name: t.tensor_type.name
        for name, t in by_name.items()
        if t.tensor_type.name in QUANTIZED_TYPES and len(t.shape) == 2
    }

    def read_quantized(names):
        for name in names:
            tensor = by_name[name]
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dims innermost first
            try:
                weight = read_blocks(tensor.data, quantized[name], (rows, cols))
            except Exception as e:
                raise ModelLoadError(f"cannot read GGUF tensor {tensor.name} ({quantized[name]}): {e}") from e
            if tensor.name.endswith("attn_q.weight"):
                weight = weight.rows(torch.from_numpy(_unpermute(np.arange(rows), num_heads)))
            elif tensor.name.endswith("attn_k.weight"):
                weight = weight.rows(torch.from_numpy(_unpermute(np.arange(rows), num_kv_heads)))
            yield name, weight

    return Checkpoint(
        text.hf_config, text.tokenizer, iter_weights, len(reader.tensors), text.model_id, quantized, read_quantized
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None  # e.g. rope_freqs: derived from metadata instead
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    try:
        if tensor.tensor_type.name in QUANTIZED_TYPES and len(tensor.shape) == 2:  # ~2.5x faster, same bits
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))
            return read_blocks(tensor.data, tensor.tensor_type.name, shape).dequantize().numpy()
        array = quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize GGUF tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from e
    return array.astype(np.float32, copy=False)


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved pairs -> halves) per head."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
