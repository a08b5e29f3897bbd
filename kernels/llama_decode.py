"""One decode token through a whole Llama stack with 4-bit weights in one C call
(csrc/llama_decode.c, linked with csrc/paged_attention.c): every layer's norms, projections,
rotary embedding, KV store, attention and MLP with no Python in between.

services' Llama int4 decode path calls it (through moemesh.kernels) for a round of one request
and one token, where the eager stack spends more time dispatching ops than moving weights.
What it computes and where it rounds: llama_decode.c's header. No compiler, or a failed build:
`library()` is None (logged) and the model runs its eager stack.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from moemesh.kernels.c_library import CSRC, NATIVE_FLAGS, compile_library

SOURCES = (CSRC / "llama_decode.c", CSRC / "paged_attention.c")


@functools.lru_cache(maxsize=4)
def build(target_flags: tuple[str, ...] = NATIVE_FLAGS) -> ctypes.CDLL | None:
    """The library compiled with `target_flags` (tests also build AVX2-only and scalar copies), or
    None where no compiler is found or the build fails (logged)."""
    lib = compile_library(SOURCES, target_flags, "one-token decode runs the eager stack")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.int4_llama_decode_token.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64]
    lib.int4_llama_decode_token.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    return build(NATIVE_FLAGS)


class Int4Layer(ctypes.Structure):
    """One Llama layer's tensors for int4_llama_decode_token (llama_decode.c's Int4Layer):
    addresses of the norm weights, each projection's 4-bit codes with their scales (int4pack:
    [G, N, 2] bfloat16 scale and zero; GGUF nibbles: [N, G] scales and, or 0, mins; 4-bit code
    blocks: [G, N] scales and mins), and the layer's KV cache."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            *("input_norm", "post_norm"),
            *("qkv", "o", "gate_up", "down"),
            *("qkv_sz", "o_sz", "gate_up_sz", "down_sz"),
            *("qkv_min", "o_min", "gate_up_min", "down_min"),
            *("k_cache", "v_cache"),
        )
    ]


# Int4Dims.format: int4pack with bf16 activations; GGUF nibbles or 4-bit code blocks with float32
FORMAT_INT4PACK, FORMAT_NIBBLES, FORMAT_BLOCKS = 0, 1, 2
INT4_FORMATS = {"int4pack": FORMAT_INT4PACK, "nibbles": FORMAT_NIBBLES, "blocks": FORMAT_BLOCKS}  # by projection form
# Int4Dims' int64 fields, in llama_decode.c's order
_DIMS = "hidden heads kv_heads head_dim intermediate group block_n num_blocks block_size max_position rotary_dim"
_LAYOUT = "format bf16 half"  # the projections' layout; activations bfloat16 (1) or float32; nibble scales float16


class Int4Dims(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in (*_DIMS.split(), *_LAYOUT.split())),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos_sin", ctypes.c_void_p),
    ]


def int4_llama_decode_token(
    dims: Int4Dims,
    layers: ctypes.Array,  # of Int4Layer
    hidden: torch.Tensor,  # [hidden] in the activation dtype, contiguous: the embedding in, the last MLP output out
    residual: torch.Tensor,  # [hidden] likewise: written
    position: int,
    slot: int,
    block_table: torch.Tensor,  # [max_blocks] int32, contiguous
    context_len: int,
    lib: ctypes.CDLL | None = None,
    threads: int | None = None,  # default: torch's; more than one: a second thread takes half of each GEMV
) -> None:
    """One token through every layer (llama_decode.c int4_llama_decode_token); IndexError for a
    position, slot, block or shape it does not take, found before anything is written."""
    lib = lib or library()
    threads = torch.get_num_threads() if threads is None else threads
    table, num_blocks = block_table.data_ptr(), block_table.shape[0]
    rc = lib.int4_llama_decode_token(
        ctypes.byref(dims),
        layers,
        len(layers),
        hidden.data_ptr(),
        residual.data_ptr(),
        position,
        slot,
        table,
        num_blocks,
        context_len,
        threads,
    )
    if rc == -2:
        raise MemoryError("int4_llama_decode_token: no memory for the activations")
    if rc != 0:
        raise IndexError(
            f"int4_llama_decode_token: position {position}, slot {slot} or context {context_len} outside the "
            "cache or the rotary table, or shapes it does not take"
        )
