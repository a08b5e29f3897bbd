"""GGUF (llama.cpp) checkpoints: dequantize Q4_1/Q8_0/F16/F32 (any type `gguf` knows) and map
tensor names and metadata onto the Hugging Face Llama layout.

llama.cpp stores attn_q/attn_k rows permuted for its interleaved RoPE; we undo that so the
weights match HF's rotate-half RoPE.
"""

from __future__ import annotations

import os
import re

import numpy as np
import torch

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.tokenizer import Tokenizer

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
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: llama)")
    tensor_names = {t.name for t in reader.tensors}
    hf_config = _hf_config(meta, tensor_names)
    num_heads, num_kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]

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

    stat = os.stat(path)
    return Checkpoint(
        hf_config=hf_config,
        tokenizer=Tokenizer.from_gguf_metadata(meta.get),
        iter_weights=iter_weights,
        num_tensors=len(reader.tensors),
        model_id=f"{meta.get('general.name') or os.path.basename(path)}:{stat.st_size}",
    )


class _Metadata:
    def __init__(self, reader):
        self._fields = reader.fields

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        return field.contents()


def _hf_config(meta: _Metadata, tensor_names: set[str]) -> dict:
    def need(key):
        value = meta.get(f"llama.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks llama.{key}")
        return value

    num_heads = need("attention.head_count")
    hidden = need("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": meta.get("llama.vocab_size") or len(tokens),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv") or num_heads,
        "head_dim": meta.get("llama.attention.key_length") or hidden // num_heads,
        "max_position_embeddings": meta.get("llama.context_length") or 2048,
        "rms_norm_eps": meta.get("llama.attention.layer_norm_rms_epsilon") or 1e-5,
        "rope_theta": meta.get("llama.rope.freq_base") or 10000.0,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": meta.get("llama.rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")
    return config


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
        array = quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize GGUF tensor {tensor.name} ({tensor.tensor_type.name}): {e}") from e
    return array.astype(np.float32, copy=False)


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (interleaved pairs -> halves) per head."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
