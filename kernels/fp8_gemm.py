"""FP8 Linear with DeepSeek-V3 block scales: y = x @ W^T, W = weight * scale_inv[block] (see fp8.py).

Two torch references, neither of which ever holds the whole dequantized weight: they walk the
output features in tiles of `tile_rows` rows (a multiple of block_n; by default as many as keep
a tile under TILE_ELEMENTS) and dequantize only that tile.
- `fp8_linear_w8a16_ref`: weights dequantized per tile to x's dtype, activations untouched; the
  CPU serving path and the accuracy reference.
- `fp8_linear_w8a8_ref`: activations quantized per token per block_k group (act_quant_ref), then
  per (tile, K block) the fp8 values are multiplied in fp32 and scaled by x_scale * w_scale, as
  the Triton kernel does.

Triton (CUDA): `act_quant_triton` then `_fp8_gemm_kernel`, one program per [BLOCK_M, BLOCK_N]
output tile; each K step of block_k is one fp8 `tl.dot` (fp32 accumulate) scaled by the row's
activation scale and the columns' weight scales, as DeepSeek-V3's reference kernel does.
"""

from __future__ import annotations

import torch

from moemesh.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_contiguous,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    check_out,
    check_shape,
    launch,
    tl,
    triton,
)
from moemesh.kernels.fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    act_quant_ref,
    act_quant_triton,
    cdiv,
    check_block,
    check_block_scaled,
    dequant_rows,
)

TILE_ELEMENTS = 1 << 21  # default bound on one dequantized weight tile (8 MiB in fp32)


def default_tile_rows(k: int, block_n: int) -> int:
    """Rows per dequantized tile: a multiple of block_n, at most ~TILE_ELEMENTS elements."""
    return max(1, TILE_ELEMENTS // max(k, 1) // block_n) * block_n


def _check_linear(name: str, x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block, tile_rows):
    check_block_scaled(name, weight, scale_inv, block)
    check_shape(name, "weight", weight, (None, None))
    check_shape(name, "x", x, (None, weight.shape[1]))
    block_n = block[0]
    tile_rows = default_tile_rows(weight.shape[1], block_n) if tile_rows is None else tile_rows
    if tile_rows <= 0 or tile_rows % block_n:
        raise ValueError(f"{name}: tile_rows must be a positive multiple of block_n={block_n}, got {tile_rows}")
    return tile_rows


def fp8_linear_w8a16_ref(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int] = DEFAULT_BLOCK,
    tile_rows: int | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """Weight-only FP8: each tile of rows dequantized to x.dtype, then one matmul per tile."""
    name = "fp8_linear_w8a16_ref"
    check_dtype(name, "x", x, FLOAT_DTYPES)
    tile_rows = _check_linear(name, x, weight, scale_inv, block, tile_rows)
    n = weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)  # [M, N]
    for start in range(0, n, tile_rows):
        end = min(n, start + tile_rows)
        tile = dequant_rows(weight, scale_inv, start, end, block, x.dtype)  # [end - start, K]
        out[:, start:end] = x @ tile.t()
    return out


def fp8_gemm_ref(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn
    x_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int] = DEFAULT_BLOCK,
    tile_rows: int | None = None,
) -> torch.Tensor:  # [M, N] float32
    """sum over K blocks b of (x_q[:, b] @ weight[:, b]^T) * x_scale[:, b] * w_scale[:, b], fp32."""
    name = "fp8_gemm_ref"
    check_dtype(name, "x_q", x_q, (FP8_DTYPE,))
    tile_rows = _check_linear(name, x_q, weight, scale_inv, block, tile_rows)
    block_n, block_k = block
    (m, k), n = x_q.shape, weight.shape[0]
    check_shape(name, "x_scale", x_scale, (m, cdiv(k, block_k)))
    x = x_q.to(torch.float32)  # [M, K] (activation-sized)
    out = torch.empty(m, n, dtype=torch.float32, device=x_q.device)  # [M, N]
    for start in range(0, n, tile_rows):
        end = min(n, start + tile_rows)
        tile = weight[start:end].to(torch.float32)  # [rows, K] raw e4m3 values
        w_scale = scale_inv[start // block_n : cdiv(end, block_n)].repeat_interleave(block_n, 0)[: end - start]
        acc = torch.zeros(m, end - start, dtype=torch.float32, device=x_q.device)  # [M, rows]
        for b, k0 in enumerate(range(0, k, block_k)):
            k1 = min(k, k0 + block_k)
            acc += (x[:, k0:k1] @ tile[:, k0:k1].t()) * (x_scale[:, b, None] * w_scale[None, :, b])
        out[:, start:end] = acc
    return out


def fp8_linear_w8a8_ref(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int] = DEFAULT_BLOCK,
    tile_rows: int | None = None,
) -> torch.Tensor:  # [M, N] in x.dtype
    """The Triton path's math in torch: act_quant_ref, then fp8_gemm_ref."""
    check_dtype("fp8_linear_w8a8_ref", "x", x, FLOAT_DTYPES)
    x_q, x_scale = act_quant_ref(x, check_block("fp8_linear_w8a8_ref", block)[1])
    return fp8_gemm_ref(x_q, x_scale, weight, scale_inv, block, tile_rows).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr,  # [M, K] float8e4nv, contiguous
        a_scale_ptr,  # [M, NUM_K_BLOCKS] float32
        b_ptr,  # [N, K] float8e4nv, contiguous
        b_scale_ptr,  # [ceil(N / SCALE_BLOCK_N), NUM_K_BLOCKS] float32
        c_ptr,  # [M, N]
        num_rows,
        N: tl.constexpr,
        K: tl.constexpr,
        NUM_K_BLOCKS: tl.constexpr,
        SCALE_BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # = the scales' block_k
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_valid = rows < num_rows
        col_valid = cols < N
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * K + ks[None, :]
        b_ptrs = b_ptr + cols64[None, :] * K + ks[:, None]
        a_scale_ptrs = a_scale_ptr + rows64 * NUM_K_BLOCKS
        b_scale_ptrs = b_scale_ptr + (cols // SCALE_BLOCK_N) * NUM_K_BLOCKS
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(NUM_K_BLOCKS):
            k_valid = ks < K - kb * BLOCK_K
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(
                b_ptrs + kb * BLOCK_K, mask=k_valid[:, None] & col_valid[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_N]
            a_scale = tl.load(a_scale_ptrs + kb, mask=row_valid, other=0.0)
            b_scale = tl.load(b_scale_ptrs + kb, mask=col_valid, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        c_ptrs = c_ptr + rows64[:, None] * N + cols64[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def gemm_tiles(m: int) -> dict:
    """Tile sizes by token count: narrow N tiles for decode (more programs over the weight)."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def check_block_k(name: str, block_k: int) -> None:
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"{name}: the Triton FP8 kernels need block_k a power of two >= 16, got {block_k}")


def fp8_gemm_triton(
    x_q: torch.Tensor,  # [M, K] float8_e4m3fn, contiguous
    x_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32, contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32, contiguous
    out_dtype: torch.dtype = torch.bfloat16,
    block: tuple[int, int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,  # [M, N] out_dtype
) -> torch.Tensor:  # [M, N]
    name = "fp8_gemm_triton"
    check_launchable(name, x_q, x_scale, weight, scale_inv)
    check_block_scaled(name, weight, scale_inv, block)
    check_shape(name, "weight", weight, (None, None))
    check_dtype(name, "x_q", x_q, (FP8_DTYPE,))
    check_shape(name, "x_q", x_q, (None, weight.shape[1]))
    (m, k), n = x_q.shape, weight.shape[0]
    block_n, block_k = block
    check_block_k(name, block_k)
    num_k_blocks = cdiv(k, block_k)
    check_shape(name, "x_scale", x_scale, (m, num_k_blocks))
    check_dtype(name, "x_scale", x_scale, (torch.float32,))
    for what, t in (("x_q", x_q), ("x_scale", x_scale), ("weight", weight), ("scale_inv", scale_inv)):
        check_contiguous(name, what, t)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {out_dtype}")
    out = check_out(name, out, torch.empty(0, dtype=out_dtype, device=x_q.device), (m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles = gemm_tiles(m)
    launch(
        _fp8_gemm_kernel,
        (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"])),
        x_q,
        x_scale,
        weight,
        scale_inv,
        out,
        m,
        N=n,
        K=k,
        NUM_K_BLOCKS=num_k_blocks,
        SCALE_BLOCK_N=block_n,
        BLOCK_K=block_k,
        **tiles,
    )
    return out


def fp8_linear_triton(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, dense rows
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32, contiguous
    block: tuple[int, int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,  # [M, N] x.dtype
) -> torch.Tensor:  # [M, N] in x.dtype
    """W8A8: per-token-group activation quantization, then the block-scaled FP8 GEMM."""
    name = "fp8_linear_triton"
    check_launchable(name, x, weight, scale_inv)
    check_dtype(name, "x", x, FLOAT_DTYPES)
    check_shape(name, "x", x, (None, weight.shape[-1]))
    check_inner_contiguous(name, "x", x, 1)
    block_n, block_k = check_block(name, block)
    check_block_k(name, block_k)
    x_q, x_scale = act_quant_triton(x, block_k)  # [M, K] e4m3, [M, ceil(K / block_k)]
    return fp8_gemm_triton(x_q, x_scale, weight, scale_inv, x.dtype, (block_n, block_k), out)
