"""Group-quantized GEMV on the CPU: the C kernel in csrc/group_gemv.c, compiled at first use.

PyTorch has no CPU kernel for these weights at a decode round's few rows: `_weight_int8pack_mm`
scales whole rows, so GGUF's Q8_0 (a scale per 32 columns) took one call per group (SmolLM2's
tied lm_head, [49152, 576]: 18 calls, 5.5 ms per decode token), and `_weight_int4pack_mm_for_cpu`
takes bfloat16 activations only (float32 ones dequantized the whole weight per call). This
kernel reads GGUF's codes as the file lays them out, once for all rows of x, with the exact
float16 / float32 scales and mins, in float32: 1.4-1.6 ms for that lm_head at one row, the
memory's bandwidth. For 4-bit codes with bfloat16 activations int4pack stays faster (83 against
139 us for [3072, 576] at one row; a bf16 dot-product variant of this kernel measured slower still).
Weights of at least PARALLEL_MIN_WEIGHTS codes split their output rows over torch's thread count
(torch's OpenMP threads, c_parts.h; each row is summed as with one thread): that lm_head at
two threads, 1.6 -> 1.1 ms.

Rounds of more rows rebuild the weight and multiply densely; the same library rebuilds it:
`dequantize` (these layouts, to float32 or bfloat16: 0.1 ns per weight, 10x torch's ops) and
`int4pack_dequantize` (PyTorch's int4pack layout, to W^T in bfloat16), both rounding the exact
value once. The int4pack layout is ATen's, not a documented format: `int4pack_block_n` finds its
row blocks on this machine by packing a probe and reading it back, and says None (callers keep
int4pack's own kernel) if the layout is not the one the C code reads.

The library is built for this machine by kernels/c_library.py. No compiler, or a failed build:
`library()` is None (logged once) and the callers dequantize per call with torch instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from moemesh.kernels.c_library import CSRC, NATIVE_FLAGS, compile_library, declare_parts, run_parts

log = logging.getLogger(__name__)

SOURCE = CSRC / "group_gemv.c"
MAX_M = 8  # rows of x per call (the C side's MAX_M); more rows are taken MAX_M at a time


@functools.lru_cache(maxsize=4)
def build(target_flags: tuple[str, ...] = NATIVE_FLAGS) -> ctypes.CDLL | None:
    """The kernel compiled with `target_flags` (tests also build AVX2-only and scalar copies), or
    None where no compiler is found or the build fails (logged)."""
    lib = compile_library(SOURCE, target_flags, "weights dequantize per call with torch instead")
    if lib is None:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.group_gemv.argtypes = [ptr, i32, ptr, ptr, i32, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    lib.group_gemv.restype = i32
    lib.group_dequantize.argtypes = [ptr, i32, ptr, ptr, i32, ptr, i64, i64, i64, i64, i64, ptr, i32]
    lib.group_dequantize.restype = i32
    lib.int4pack_dequantize.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ptr]
    lib.int4pack_dequantize.restype = i32
    lib.group_gemv_width.restype = i32
    lib.blocks_gemv.argtypes = [ptr, i32, ptr, ptr, i32, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.blocks_gather.argtypes = [ptr, i32, ptr, ptr, i32, i64, i64, i64, i64, ptr, i64, i64, i64, ptr]
    lib.blocks_gemm.argtypes = [ptr, i32, ptr, ptr, i32, ptr, ptr, i64, i64, i64, i64, i64, i64, i64]
    lib.blocks_gemm_bf16.argtypes = lib.blocks_gemm.argtypes
    for name in (
        "blocks_gemv",
        "blocks_gemm",
        "blocks_gemm_bf16",
        "blocks_gather",
        "blocks_block_n",
        "blocks_bf16_gemm",
    ):
        getattr(lib, name).restype = i32
    declare_parts(lib, "group_gemv", 12)
    declare_parts(lib, "group_dequantize", 7)
    declare_parts(lib, "int4pack_dequantize", 8)
    declare_parts(lib, "blocks_gemv", 13)
    declare_parts(lib, "blocks_gemm", 12)
    declare_parts(lib, "blocks_gemm_bf16", 12)
    declare_parts(lib, "blocks_gather", 11)
    log.info(
        "group-quantized GEMV built for %s (%d-bit vectors)",
        " ".join(target_flags) or "no target flags",
        lib.group_gemv_width(),
    )
    return lib


def library() -> ctypes.CDLL | None:
    return build(NATIVE_FLAGS)


def group_gemv(
    x: torch.Tensor,  # [M, K], any floating dtype
    codes: torch.Tensor,  # [N, K] int8, or [N, K / 2] uint8 nibbles (group_gemv.c's layout)
    scale: torch.Tensor,  # [N, K // group] float32 or float16
    mins: torch.Tensor | None = None,  # like scale (same dtype), or None
    lib: ctypes.CDLL | None = None,  # default: library()
) -> torch.Tensor:  # [M, N] float32
    """y = x @ W^T with W[n, g * group + j] = scale[n, g] * q[n, g, j] (+ mins[n, g]), in float32."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("group_gemv: the C kernel is not available (no compiler or a failed build)")
    m, k = x.shape
    n, num_groups = scale.shape
    nibbles = codes.dtype == torch.uint8
    expected = (n, k // 2 if nibbles else k)
    if codes.shape != expected or k % num_groups or codes.dtype not in (torch.int8, torch.uint8):
        raise ValueError(
            f"group_gemv: x {tuple(x.shape)}, codes {tuple(codes.shape)} {codes.dtype}, scale {tuple(scale.shape)}"
        )
    half = scale.dtype == torch.float16
    if scale.dtype not in (torch.float16, torch.float32) or (mins is not None and mins.dtype != scale.dtype):
        raise ValueError("group_gemv: scale (and mins) must be float16 or float32, of one dtype")
    if not all(t is None or t.is_contiguous() for t in (codes, scale, mins)):
        raise ValueError("group_gemv: codes, scale and mins must be contiguous")
    group = k // num_groups
    xf = x.detach().to(torch.float32).contiguous()
    xsum = xf.view(m, num_groups, group).sum(-1) if mins is not None else xf  # [M, G] (unread without mins)
    y = torch.empty(m, n, dtype=torch.float32)
    mins_ptr = mins.data_ptr() if mins is not None else None
    parts = _row_ranges(n, n * k, torch.get_num_threads())
    for r in range(0, m, MAX_M):
        rows = min(MAX_M, m - r)
        args = (
            codes.data_ptr(),
            int(nibbles),
            scale.data_ptr(),
            mins_ptr,
            int(half),
            xf[r].data_ptr(),
            xsum[r].data_ptr(),
            y[r].data_ptr(),
            rows,
            n,
            k,
            group,
        )
        if run_parts(lib, "group_gemv", args, (), parts) != 0:  # each thread a range of output rows
            raise ValueError(f"group_gemv: unsupported shapes (N={n}, K={k}, group={group}, nibbles={nibbles})")
    return y


def dequantize(
    codes: torch.Tensor,  # [N, K] int8, or [N, K / 2] uint8 nibbles
    scale: torch.Tensor,  # [N, K // group] float32 or float16
    mins: torch.Tensor | None,  # like scale, or None
    dtype: torch.dtype,  # float32 or bfloat16
    rows: slice | torch.Tensor = slice(None),  # a range of rows, or row indices (a gather)
    out: torch.Tensor | None = None,  # [R, K] of `dtype`, contiguous
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [R, K]
    """Rows of W (as group_gemv reads it) in `dtype`: code * scale (+ min) in float32, rounded once."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("dequantize: the C kernel is not available (no compiler or a failed build)")
    n, num_groups = scale.shape
    nibbles = codes.dtype == torch.uint8
    k = codes.shape[1] * (2 if nibbles else 1)
    if dtype not in (torch.float32, torch.bfloat16) or scale.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"dequantize: {dtype} output from {scale.dtype} scales")
    index, begin, num = _row_selection(rows, n)
    if out is None:
        out = torch.empty(num, k, dtype=dtype)
    if out.shape != (num, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"dequantize: out {tuple(out.shape)} {out.dtype}, expected ({num}, {k}) {dtype}")
    args = (
        codes.data_ptr(),
        int(nibbles),
        scale.data_ptr(),
        None if mins is None else mins.data_ptr(),
        int(scale.dtype == torch.float16),
        None if index is None else index.data_ptr(),
        begin,
    )
    tail = (k, k // num_groups, out.data_ptr(), int(dtype == torch.bfloat16))
    _run_split(lib, "group_dequantize", args, tail, _row_ranges(num, num * k, torch.get_num_threads()))
    return out


@functools.cache
def int4pack_block_n() -> int | None:
    """The rows per block of PyTorch's CPU int4pack layout on this machine (it follows the vector
    width ATen dispatches to: 64 with AVX-512, 32 with AVX2), found by packing a probe and checked
    against int4pack_dequantize's reading of it; None if the layout is not the one it reads."""
    lib = library()
    if lib is None:
        return None
    gen = torch.Generator().manual_seed(0)
    n, k, group = 128, 64, 32
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.stack((torch.ones(k // group, n), torch.full((k // group, n), 8.0)), -1).bfloat16()
    for block_n in (64, 32, 16, 128) if packed.shape == (n, k // 2) else ():
        w = int4pack_dequantize(packed, scales_zeros.contiguous(), group, block_n, lib=lib, check=False)
        if w is not None and torch.equal(w.t().float(), codes.float()):
            return block_n
    log.info("int4pack: an unknown CPU layout; 4-bit weights run _weight_int4pack_mm_for_cpu at every row count")
    return None


def int4pack_dequantize(
    packed: torch.Tensor,  # [N, K / 2] uint8, _convert_weight_to_int4pack_for_cpu's output
    scales_zeros: torch.Tensor,  # [G, N, 2] bfloat16
    group: int,
    block_n: int | None = None,  # default: int4pack_block_n()
    columns: slice = slice(None),  # output rows n of W (multiples of block_n)
    out: torch.Tensor | None = None,  # [K, len(columns)] bfloat16, contiguous
    lib: ctypes.CDLL | None = None,
    check: bool = True,
) -> torch.Tensor | None:  # [K, len(columns)] bfloat16: W^T, so that x @ out == x @ W^T
    """W^T of an int4pack weight, w = (q - 8) * scale + zero in float32, rounded once to bfloat16."""
    lib = lib or library()
    block_n = block_n or int4pack_block_n()
    if lib is None or block_n is None:
        raise RuntimeError("int4pack_dequantize: no C kernel or an unknown int4pack layout here")
    n, k = packed.shape[0], packed.shape[1] * 2
    begin, end, _ = columns.indices(n)
    if out is None:
        out = torch.empty(k, end - begin, dtype=torch.bfloat16)
    if check and (
        out.shape != (k, end - begin)
        or out.dtype != torch.bfloat16
        or not out.is_contiguous()
        or scales_zeros.dtype != torch.bfloat16
        or scales_zeros.shape != (k // group, n, 2)
    ):
        raise ValueError(
            f"int4pack_dequantize: out {tuple(out.shape)} {out.dtype}, scales_zeros "
            f"{tuple(scales_zeros.shape)} {scales_zeros.dtype} for a [{n}, {k}] weight"
        )
    args = (packed.data_ptr(), scales_zeros.data_ptr(), n, k, group, block_n, begin, end)
    parts = _row_ranges(k, k * (end - begin), torch.get_num_threads())
    ok = _run_split(lib, "int4pack_dequantize", args, (out.data_ptr(),), parts, raise_on_error=check)
    return out if ok else None


# -- code blocks (code_blocks.h): 4- or 8-bit codes in row blocks, exact group-major scales ---------
# 4-bit codes: uint8 [N, K / 2], two rows per byte; 8-bit: int8 [N, K]; scales and mins [G, N].


def blocks_block_n(lib: ctypes.CDLL | None = None) -> int | None:
    """The row block the C library's vector loops read (64 with AVX-512, 32 with AVX2), or None
    (no library, or scalar loops only: weights then keep GGUF's row layouts)."""
    lib = lib or library()
    return (lib.blocks_block_n() or None) if lib is not None else None


def blocks_bf16_gemm(lib: ctypes.CDLL | None = None) -> bool:
    """Whether blocks_gemm multiplies bfloat16 x with bfloat16 dot products (AVX512-BF16, blocks of
    64 rows); elsewhere it multiplies bfloat16 x in float32."""
    lib = lib or library()
    return lib is not None and bool(lib.blocks_bf16_gemm())


def _blocks_args(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, block_n: int) -> tuple:
    """(packed, bits, scale, mins, half, n, k, group) after the checks every entry point shares;
    the codes' dtype says their width (uint8: 4-bit pairs, int8: 8-bit)."""
    num_groups, n = scale.shape  # [G, N]
    bits = {torch.uint8: 4, torch.int8: 8}.get(packed.dtype, 0)
    k = packed.shape[1] * (2 if bits == 4 else 1)
    if not bits or packed.shape[0] != n or k % num_groups or n % block_n:
        raise ValueError(
            f"code blocks: packed {tuple(packed.shape)} {packed.dtype}, scale {tuple(scale.shape)}, blocks of {block_n}"
        )
    if scale.dtype not in (torch.float16, torch.float32) or (mins is not None and mins.dtype != scale.dtype):
        raise ValueError("code blocks: scale (and mins) must be float16 or float32, of one dtype")
    if not all(t is None or t.is_contiguous() for t in (packed, scale, mins)) or (
        mins is not None and mins.shape != scale.shape
    ):
        raise ValueError("code blocks: packed, scale and mins must be contiguous, mins shaped like scale")
    mins_ptr = None if mins is None else mins.data_ptr()
    half = int(scale.dtype == torch.float16)
    return packed.data_ptr(), bits, scale.data_ptr(), mins_ptr, half, n, k, k // num_groups


def blocks_gemv(
    x: torch.Tensor,  # [M, K], any floating dtype
    packed: torch.Tensor,  # [N, K / 2] uint8 or [N, K] int8 (blocks_from_codes)
    scale: torch.Tensor,  # [G, N] float16 or float32
    mins: torch.Tensor | None,  # like scale, or None
    block_n: int,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [M, N] float32
    """y = x @ W^T, W[n, g * group + j] = scale[g, n] * q (+ mins[g, n]), float32 sums."""
    lib = lib or library()
    codes_ptr, bits, scale_ptr, mins_ptr, half, n, k, group = _blocks_args(packed, scale, mins, block_n)
    m = x.shape[0]
    if x.shape != (m, k):
        raise ValueError(f"blocks_gemv: x {tuple(x.shape)} for a [{n}, {k}] weight")
    xf = x.detach().to(torch.float32).contiguous()
    xsum = xf.view(m, k // group, group).sum(-1) if mins is not None else xf  # [M, G] (unread without mins)
    y = torch.empty(m, n, dtype=torch.float32)
    args = (
        codes_ptr,
        bits,
        scale_ptr,
        mins_ptr,
        half,
        xf.data_ptr(),
        xsum.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
        group,
        block_n,
    )
    _run_split(lib, "blocks_gemv", args, (), _block_ranges(n, block_n, n * k, torch.get_num_threads()))
    return y


def blocks_gemm(
    x: torch.Tensor,  # [M, K] float32 or bfloat16
    packed: torch.Tensor,
    scale: torch.Tensor,  # [G, N]
    mins: torch.Tensor | None,
    block_n: int,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [M, N] float32
    """y = x @ W^T for rounds of several rows: each block's W^T rebuilt a slice at a time in cache
    and multiplied there (code_blocks.h cb_gemm); vector loops for the library's own block_n
    (blocks_block_n), a scalar loop for others. bfloat16 x with blocks_bf16_gemm(): W rounded to
    bfloat16 and bfloat16 dot products (cb_gemm_bf16), float32 sums; else x is read in float32."""
    lib = lib or library()
    codes_ptr, bits, scale_ptr, mins_ptr, half, n, k, group = _blocks_args(packed, scale, mins, block_n)
    m = x.shape[0]
    if x.shape != (m, k) or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"blocks_gemm: x {tuple(x.shape)} {x.dtype} for a [{n}, {k}] weight (float32 or bfloat16)")
    name = "blocks_gemm"
    if x.dtype == torch.bfloat16 and block_n == 64 and k % 2 == 0 and blocks_bf16_gemm(lib):
        name = "blocks_gemm_bf16"
    x = x.to(torch.float32).contiguous() if name == "blocks_gemm" else x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    args = (codes_ptr, bits, scale_ptr, mins_ptr, half, x.data_ptr(), y.data_ptr(), m, n, k, group, block_n)
    _run_split(lib, name, args, (), _block_ranges(n, block_n, n * k, torch.get_num_threads()))
    return y


def blocks_gather(
    packed: torch.Tensor,
    scale: torch.Tensor,  # [G, N]
    mins: torch.Tensor | None,
    block_n: int,
    rows: slice | torch.Tensor = slice(None),  # a range of rows, or row indices
    out: torch.Tensor | None = None,  # [R, K] float32, contiguous
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [R, K] float32
    """Rows of W in float32: scale * q + min, rounded once (GGUF's dequantized values)."""
    lib = lib or library()
    codes_ptr, bits, scale_ptr, mins_ptr, half, n, k, group = _blocks_args(packed, scale, mins, block_n)
    index, begin, num = _row_selection(rows, n)
    if out is None:
        out = torch.empty(num, k, dtype=torch.float32)
    if out.shape != (num, k) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"blocks_gather: out {tuple(out.shape)} {out.dtype}, expected ({num}, {k}) float32")
    args = (
        codes_ptr,
        bits,
        scale_ptr,
        mins_ptr,
        half,
        n,
        k,
        group,
        block_n,
        None if index is None else index.data_ptr(),
        begin,
    )
    _run_split(lib, "blocks_gather", args, (out.data_ptr(),), _row_ranges(num, num * k, torch.get_num_threads()))
    return out


def _row_selection(rows: slice | torch.Tensor, n: int) -> tuple[torch.Tensor | None, int, int]:
    """(int64 indices or None, first row, count) for a contiguous slice or an index tensor, checked."""
    if isinstance(rows, slice):
        begin, end, step = rows.indices(n)
        if step != 1:
            raise ValueError("a row slice must be contiguous")
        return None, begin, max(0, end - begin)
    index = rows.reshape(-1).to(torch.int64).contiguous()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
        raise IndexError(f"row index out of range for {n} rows")
    return index, 0, index.numel()


def _block_ranges(n: int, block_n: int, num_weights: int, threads: int) -> list[tuple[int, int]]:
    """[begin, end) output rows per thread in whole blocks: as _row_ranges, a block at least per thread."""
    blocks = n // block_n
    parts = max(1, min(threads, blocks)) if num_weights >= PARALLEL_MIN_WEIGHTS else 1
    bounds = [blocks * i // parts * block_n for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _run_split(lib, name: str, args: tuple, tail: tuple, parts: list[tuple[int, int]], raise_on_error=True) -> bool:
    """NAME(*args, begin, end, *tail) over the parts (c_library.run_parts); False (or ValueError) on a
    refusal."""
    if run_parts(lib, name, args, tail, parts) != 0:
        if raise_on_error:
            raise ValueError(f"{name}: unsupported shapes {args[2:]}")
        return False
    return True


# below this many codes one thread is faster than the hand-off to torch's (spinning) OpenMP threads;
# SmolLM2 at M = 64, two threads, with 1 << 17 instead of 1 << 20 (qkv, o and down now split their
# dequantization): bf16 qkv 0.42 -> 0.35, down 0.6 -> 0.49 ms; float32 qkv 0.65 -> 0.57 ms
PARALLEL_MIN_WEIGHTS = 1 << 17


def _row_ranges(n: int, num_weights: int, threads: int) -> list[tuple[int, int]]:
    """[begin, end) output rows per thread: torch's thread count for large weights, else one."""
    parts = max(1, min(threads, n // 64)) if num_weights >= PARALLEL_MIN_WEIGHTS else 1
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
