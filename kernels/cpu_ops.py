"""The decoder's small per-token operations on the CPU in C (csrc/cpu_ops.c with
csrc/paged_attention.c, one library): fused add + RMSNorm, NeoX rotary embedding, the KV-cache
store, decode attention and the prefill attention of short prompts, one ctypes call each.

kernels/dispatch.py calls these for CPU tensors of float32 or bfloat16 whose layout they read
(rows contiguous in their last dimension) when the library is built, and the torch references
otherwise. What each computes, and where it rounds, is the reference's (cpu_ops.c's header); at
one decode token per round they replace ~30 torch ops per layer (SmolLM2, one request: RMSNorm
37 -> 19 us, rotary 51 -> 20 us, KV store 26 -> 13 us, measured inside the model; most of what is
left is the Python around each call). Decode attention over a few dozen cached tokens costs what
PyTorch's fused SDPA spends on set-up alone (~60 us); a round of many requests splits them over
torch's own OpenMP threads (the `*_parts` entry points, c_parts.h).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from moemesh.kernels.c_library import CSRC, NATIVE_FLAGS, compile_library, declare_parts, run_parts

log = logging.getLogger(__name__)

SOURCES = (CSRC / "cpu_ops.c", CSRC / "paged_attention.c")
MAX_HIDDEN = 16384  # rms_norm's and rope_neox's row buffers in cpu_ops.c
DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=4)
def build(target_flags: tuple[str, ...] = NATIVE_FLAGS) -> ctypes.CDLL | None:
    lib = compile_library(SOURCES, target_flags, "the decoder's small ops run as torch ops")
    if lib is None:
        return None
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.rope_neox.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i32]
    lib.store_kv.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.paged_decode_attention.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        ptr,
        i64,
        i64,
        i32,
    ]
    lib.paged_prefill_attention.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        f32,
        ptr,
        i64,
        i64,
        i32,
    ]
    for fn in (lib.rms_norm, lib.rope_neox, lib.store_kv, lib.paged_decode_attention, lib.paged_prefill_attention):
        fn.restype = i32
    declare_parts(lib, "paged_decode_attention", 14)
    declare_parts(lib, "paged_prefill_attention", 15)
    return lib


def library() -> ctypes.CDLL | None:
    return build(NATIVE_FLAGS)


def _rows_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A 2-D or 3-D CPU tensor of `dtype` whose rows (all but the first dim) are dense."""
    if t.dtype != dtype or t.device.type != "cpu":
        return False
    n, s = t.shape, t.stride()
    if t.dim() == 2:
        return s[1] == 1 or n[1] == 1
    return t.dim() == 3 and (s[2] == 1 or n[2] == 1) and (s[1] == n[2] or n[1] == 1)


def rms_norm_usable(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    return (
        x.dtype in DTYPES
        and x.dim() == 2
        and 0 < x.shape[1] <= MAX_HIDDEN
        and _rows_ok(x, x.dtype)
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.device.type == "cpu"
        and (residual is None or (_rows_ok(residual, x.dtype) and residual.shape == x.shape))
        and library() is not None
    )


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden], rows dense
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # like x
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) * weight, or with `residual` (rms_norm(x + residual) * weight, x + residual)."""
    lib = lib or library()
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    summed = torch.empty(rows, hidden, dtype=x.dtype) if residual is not None else None
    rc = lib.rms_norm(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        None if summed is None else summed.data_ptr(),
        rows,
        hidden,
        eps,
        int(x.dtype == torch.bfloat16),
    )
    if rc != 0:
        raise ValueError(f"rms_norm: unsupported hidden size {hidden}")
    return out if residual is None else (out, summed)


def rope_usable(query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> bool:
    return (
        query.dtype in DTYPES
        and _rows_ok(query, query.dtype)
        and _rows_ok(key, query.dtype)
        and query.dim() == 3
        and key.dim() == 3
        and query.shape[2] == key.shape[2]
        and max(query.shape[1], key.shape[1]) * query.shape[2] <= MAX_HIDDEN
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[1] <= query.shape[2]
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and positions.device.type == "cpu"
        and library() is not None
    )


def rope_neox(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], each token's heads dense
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] float32, cos | sin
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) rotated, new contiguous tensors (views of one [num_tokens, heads + kv_heads,
    head_dim] buffer, as the reference's are)."""
    lib = lib or library()
    tokens, heads, head_dim = query.shape
    both = torch.empty(tokens, heads + key.shape[1], head_dim, dtype=query.dtype)
    q_out, k_out = both.split((heads, key.shape[1]), dim=1)
    max_position, rotary_dim = cos_sin_cache.shape
    bf16 = int(query.dtype == torch.bfloat16)
    for x, out in ((query, q_out), (key, k_out)):
        rc = lib.rope_neox(
            x.data_ptr(),
            x.stride(0),
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            max_position,
            out.data_ptr(),
            out.stride(0),
            tokens,
            x.shape[1],
            head_dim,
            rotary_dim,
            bf16,
        )
        if rc != 0:
            raise IndexError(f"rotary embedding: a position outside [0, {max_position}) or rotary_dim {rotary_dim}")
    return q_out, k_out


def store_kv_usable(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    return (
        key.dtype in DTYPES
        and _rows_ok(key, key.dtype)
        and _rows_ok(value, key.dtype)
        and key.dim() == 3
        and value.shape == key.shape
        and k_cache.dtype == key.dtype
        and k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and tuple(k_cache.shape[2:]) == tuple(key.shape[1:])
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and library() is not None
    )


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: not stored
    lib: ctypes.CDLL | None = None,
) -> None:
    lib = lib or library()
    if not v_cache.is_contiguous() or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("store_kv: v_cache must be contiguous and shaped like k_cache")
    tokens = key.shape[0]
    row = key.shape[1] * key.shape[2]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.store_kv(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        tokens,
        row,
        num_slots,
        int(key.dtype == torch.bfloat16),
    )
    if rc != 0:
        raise IndexError(f"store_kv: a slot beyond the cache's {num_slots}")


PARALLEL_MIN_SCORES = 1 << 14  # query heads x cached tokens below which one thread does a round


def decode_attention_usable(
    query: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> bool:
    return (
        query.dtype in DTYPES
        and _rows_ok(query, query.dtype)
        and query.dim() == 3
        and k_cache.dtype == query.dtype
        and k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and k_cache.shape[3] == query.shape[2]
        and block_tables.dtype == torch.int32
        and block_tables.is_contiguous()
        and context_lens.dtype == torch.int32
        and context_lens.is_contiguous()
        and library() is not None
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    plan=None,  # the torch reference's DecodePlan: not needed here
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    lib = lib or library()
    _check_v_cache("paged_decode_attention", k_cache, v_cache)
    num_reqs, heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty(num_reqs, heads, head_dim, dtype=query.dtype)
    if num_reqs == 0:
        return out
    work = heads * block_tables.shape[1] * block_size * num_reqs  # an upper bound on the scores
    args = (
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        num_blocks,
        block_size,
        heads,
        kv_heads,
        head_dim,
        scale,
        out.data_ptr(),
    )
    _run_requests(lib, "paged_decode_attention", args, query, num_reqs, work >= PARALLEL_MIN_SCORES, "")
    return out


def _check_v_cache(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not v_cache.is_contiguous() or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: v_cache must be contiguous and shaped like k_cache")


def _run_requests(lib, name: str, args: tuple, query: torch.Tensor, num_reqs: int, split: bool, what: str) -> None:
    """An attention op over its requests, split over torch's threads where `split`; its refusals
    raised (`what`: what else it checks)."""
    threads = torch.get_num_threads()
    parts = min(threads, num_reqs) if split and threads > 1 else 1
    bounds = [num_reqs * i // parts for i in range(parts + 1)]
    rc = run_parts(lib, name, args, (int(query.dtype == torch.bfloat16),), list(zip(bounds[:-1], bounds[1:])))
    if rc == -2:
        raise MemoryError(f"{name}: no memory for the scores")
    if rc != 0:
        heads, head_dim = query.shape[1:]
        raise IndexError(
            f"{name}: a block id{what} or context length outside the cache, or shapes past its "
            f"buffers (heads {heads}, head_dim {head_dim})"
        )


# A round's prefill runs here while each request's (query, visible token) pairs stay within this;
# longer prompts take the torch reference's batched products, faster there (SmolLM2's heads, one
# thread: 64 prompts of 33 tokens 4.0 against 15.6 ms, one of 256: 1.8 against 2.5 ms, 128 new
# tokens after 384 cached: 3.9 against 3.2 ms)
PREFILL_ATTENTION_MAX_PAIRS = 1 << 15


def prefill_attention_usable(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> bool:
    if not (
        decode_attention_usable(query, k_cache, block_tables, context_lens)
        and cu_seqlens_q.dtype == torch.int32
        and cu_seqlens_q.is_contiguous()
        and cu_seqlens_q.shape[0] == context_lens.shape[0] + 1
    ):
        return False
    q_lens, lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long(), context_lens.long()
    pairs = q_lens * (lens - q_lens) + q_lens * (q_lens + 1) // 2  # causal: token i sees the prefix and i + 1 new
    return len(pairs) == 0 or int(pairs.max()) <= PREFILL_ATTENTION_MAX_PAIRS


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32, cached prefix + new tokens
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    scale: float,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    lib = lib or library()
    _check_v_cache("paged_prefill_attention", k_cache, v_cache)
    num_tokens, heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    num_reqs = context_lens.shape[0]
    out = torch.zeros(num_tokens, heads, head_dim, dtype=query.dtype)
    if num_reqs == 0 or num_tokens == 0:
        return out
    if int(cu_seqlens_q[-1]) > num_tokens:
        raise IndexError(f"paged_prefill_attention: query offsets past its {num_tokens} tokens")
    args = (
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        cu_seqlens_q.data_ptr(),
        context_lens.data_ptr(),
        num_blocks,
        block_size,
        heads,
        kv_heads,
        head_dim,
        scale,
        out.data_ptr(),
    )
    _run_requests(lib, "paged_prefill_attention", args, query, num_reqs, True, ", a query offset")
    return out
