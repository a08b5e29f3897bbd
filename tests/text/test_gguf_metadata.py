"""moemesh's GGUF reader (a faster slicing of gguf's own) gives exactly gguf.GGUFReader's fields
and tensors on the default model's file."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from moemesh.text.gguf_metadata import _parsed_reader, open_reader


def test_fields_and_tensors_equal_gguf_readers(smollm_path):
    _parsed_reader.cache_clear()
    ours, theirs = open_reader(smollm_path), gguf.GGUFReader(smollm_path, "r")
    assert type(ours) is not gguf.GGUFReader and list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), key
        expected, got = field.contents(), mine.contents()
        assert np.array_equal(got, expected) if isinstance(expected, np.ndarray) else got == expected, key
    assert len(ours.tensors) == len(theirs.tensors) == 272 and ours.data_offset == theirs.data_offset
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.data_offset, mine.data.shape, mine.data.dtype) == (
            tensor.name,
            tensor.tensor_type,
            tensor.data_offset,
            tensor.data.shape,
            tensor.data.dtype,
        )
        assert not mine.data.flags.writeable and np.array_equal(mine.data, tensor.data), mine.name
    assert len(ours.fields["tokenizer.ggml.tokens"].data) == 49152


def test_the_loaders_float32_weights_are_ggufs_dequantization(smollm_path):
    from gguf import quants

    from moemesh.engine.loader.gguf_file import _hf_name, _unpermute, open_gguf

    checkpoint = open_gguf(smollm_path)
    heads = (checkpoint.hf_config["num_attention_heads"], checkpoint.hf_config["num_key_value_heads"])
    expected = {}
    for tensor in gguf.GGUFReader(smollm_path, "r").tensors:
        array = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            array = _unpermute(array, heads[tensor.name.endswith("attn_k.weight")])
        expected[_hf_name(tensor.name)] = array
    seen = 0
    for name, weight in checkpoint.iter_weights(
        lambda name: name.endswith(("q_proj.weight", "down_proj.weight", "embed_tokens.weight", "norm.weight"))
    ):
        assert weight.dtype == torch.float32 and np.array_equal(weight.numpy(), expected[name]), name
        seen += 1
    assert seen == 30 + 30 + 1 + 61
