"""GGUF metadata (llama.cpp key/value fields) -> the Hugging Face config the models read.
Reading metadata touches no tensor data and needs no torch."""

from __future__ import annotations

import functools
import os

from moemesh.text.errors import ModelLoadError


class GGUFMetadata:
    def __init__(self, reader):
        self._fields = reader.fields

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        return field.contents()


def open_reader(path: str):
    """A read-only GGUFReader (a memory map). Parsing the fields is seconds of Python for a 49k-token
    vocabulary, and a process reads the same file for its tokenizer and its weights: one parse per
    file version."""
    try:
        stat = os.stat(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e
    return _parsed_reader(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parsed_reader(path: str, mtime_ns: int, size: int):
    try:
        return _reader_class()(path, "r")
    except Exception as e:  # the gguf package raises assorted errors on corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e


@functools.cache
def _reader_class():
    import gguf
    import numpy as np

    class PlainViewReader(gguf.GGUFReader):
        """gguf's reader slicing a plain ndarray view of its memory map instead of the `np.memmap`
        itself: the same bytes, without memmap's Python-level `__array_finalize__` on each of the
        ~300k slices a 49k-token vocabulary takes (4x faster; every router and worker start pays
        it). Fields and tensors equal GGUFReader's (tests/common/test_gguf_metadata.py); gguf is
        pinned, and `_get` is the one method overridden."""

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            array = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainViewReader


def hf_config_from_gguf(meta: GGUFMetadata, tensor_names: set[str]) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: llama)")

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


def gguf_model_id(meta: GGUFMetadata, path: str, size: int) -> str:
    return f"{meta.get('general.name') or os.path.basename(path)}:{size}"
