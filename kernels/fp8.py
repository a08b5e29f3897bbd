"""Block-scaled FP8 (e4m3) in the DeepSeek-V3 checkpoint format: the format, quantizers, dequantizer.

Weights: a Linear's weight is stored as `weight` float8_e4m3fn [N, K] plus a float32
`weight_scale_inv` [ceil(N / block_n), ceil(K / block_k)] (block = (128, 128) in DeepSeek-V3);
the real weight is W[n, k] = float(weight[n, k]) * scale_inv[n // block_n, k // block_k].
Activations (W8A8 path): per token and per group of `block_k` channels, scale = amax / 448 and
x_q = e4m3(x / scale), so x ~ x_q * scale (x_scale [M, ceil(K / block_k)] float32).

Rounding: e4m3 round-to-nearest-even, saturating at +-448 (the GPU's cvt.rn.satfinite). The
Triton quantizers round to the e4m3 grid in fp32 arithmetic (integer ops on the bits) before the cast,
so the cast itself is exact: Triton 3.9's interpreter casts fp32 -> float8e4nv wrongly whenever
rounding carries into the exponent (127.0 -> 64.0, ties away from zero, overflow wraps), while
exact values, fp8 loads and fp8 `tl.dot` interpret correctly. On the GPU the extra rounding is a
few integer ops in a memory-bound kernel and gives the same bits as the native cast.

A group whose amax is below AMAX_EPS gets scale AMAX_EPS / 448 (all-zero rows quantize to
zeros instead of dividing by zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moemesh.kernels._triton import (
    HAS_TRITON,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    check_shape,
    launch,
    next_pow2,
    scratch,
    tl,
    triton,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_EPS = 1e-10
DEFAULT_BLOCK = (128, 128)  # (block_n, block_k) of DeepSeek-V3's weight_scale_inv


@dataclass(frozen=True)
class BlockScaledWeight:
    """One FP8 Linear weight as the checkpoint stores it (what the loader hands the layers)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        check_block_scaled("BlockScaledWeight", self.weight, self.scale_inv, self.block)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block(name: str, block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"{name}: block must be two positive sizes (block_n, block_k), got {block}")
    return int(block[0]), int(block[1])


def check_block_scaled(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """weight [..., N, K] e4m3fn and scale_inv [..., ceil(N / bn), ceil(K / bk)] float32 (leading dims equal)."""
    block_n, block_k = check_block(name, block)
    check_dtype(name, "weight", weight, (FP8_DTYPE,))
    check_dtype(name, "scale_inv", scale_inv, (torch.float32,))
    if weight.dim() < 2:
        raise ValueError(f"{name}: weight must be [..., N, K], got {list(weight.shape)}")
    n, k = weight.shape[-2:]
    check_shape(name, "scale_inv", scale_inv, (*weight.shape[:-2], cdiv(n, block_n), cdiv(k, block_k)))


def block_dequant_ref(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K]
    """The whole real weight. Materialises it: for tests and offline conversion only (the FP8
    linears dequantize bounded tiles, see fp8_gemm.py)."""
    check_block_scaled("block_dequant_ref", weight, scale_inv, block)
    return dequant_rows(weight, scale_inv, 0, weight.shape[0], block, dtype)


def dequant_rows(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    row_start: int,  # a multiple of block_n
    row_end: int,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:  # [row_end - row_start, K]
    """Rows [row_start, row_end) of the real weight: one fp32 tile (plus its cast to dtype)."""
    block_n, block_k = block
    assert row_start % block_n == 0
    k = weight.shape[1]
    tile = weight[row_start:row_end].to(torch.float32)  # [rows, K]
    rows = tile.shape[0]
    scales = scale_inv[row_start // block_n : cdiv(row_end, block_n)].repeat_interleave(block_n, 0)[:rows]
    full = k // block_k * block_k  # columns in whole K blocks
    if full:
        tile[:, :full].view(rows, full // block_k, block_k).mul_(scales[:, : full // block_k, None])
    if full < k:
        tile[:, full:].mul_(scales[:, -1:])
    return tile if dtype == torch.float32 else tile.to(dtype)


def block_quant_ref(
    w: torch.Tensor,  # [N, K] float
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K] e4m3fn, [ceil(N / bn), ceil(K / bk)] float32
    """Weight quantization as DeepSeek-V3's checkpoints are made: scale_inv = amax / 448 per block."""
    block_n, block_k = check_block("block_quant_ref", block)
    n, k = w.shape
    nb, kb = cdiv(n, block_n), cdiv(k, block_k)
    padded = F.pad(w.float(), (0, kb * block_k - k, 0, nb * block_n - n))  # [nb * bn, kb * bk]
    blocks = padded.view(nb, block_n, kb, block_k)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_EPS) / FP8_MAX  # [nb, kb]
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block_n, kb * block_k)[:n, :k].contiguous(), scale_inv


def act_quant_ref(
    x: torch.Tensor,  # [M, K]
    group_size: int = DEFAULT_BLOCK[1],
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] e4m3fn, [M, ceil(K / group_size)] float32
    """Per token, per group of `group_size` channels: scale = amax / 448, x_q = e4m3(x / scale)."""
    m, k = x.shape
    kb = cdiv(k, group_size)
    groups = F.pad(x.float(), (0, kb * group_size - k)).view(m, kb, group_size)
    scale = groups.abs().amax(dim=2).clamp(min=AMAX_EPS) / FP8_MAX  # [M, kb]
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * group_size)[:, :k].contiguous(), scale


if HAS_TRITON:

    @triton.jit
    def _act_quant_kernel(
        x_ptr,  # [M, K], dense rows
        q_ptr,  # [M, K] float8e4nv
        scale_ptr,  # [M, NUM_GROUPS] float32
        num_rows,
        x_row_stride,
        K: tl.constexpr,
        NUM_GROUPS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        mask = (rows[:, None] < num_rows) & (cols[None, :] < K)
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-10), 448.0)  # [BLOCK_ROWS]
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        # round to the e4m3 grid in fp32 (ties to even) so the cast below is exact, see the docstring
        mag = tl.abs(y)
        bits = mag.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
        subnormal = (mag + 24576.0) - 24576.0  # 1.5 * 2^14 has ulp 2^-9, e4m3's subnormal step
        mag = tl.where(mag < 0.015625, subnormal, normal)  # 2^-6: the smallest normal e4m3
        q = tl.where(y < 0, -mag, mag)  # (-0.0 stays -0.0, as the GPU's cast gives)
        tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows64 * NUM_GROUPS + group, scale, mask=rows < num_rows)


def act_quant_triton(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32, dense rows
    group_size: int = DEFAULT_BLOCK[1],
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] e4m3fn, [M, ceil(K / group_size)] float32
    name = "act_quant_triton"
    check_launchable(name, x)
    check_shape(name, "x", x, (None, None))
    check_dtype(name, "x", x, (torch.float16, torch.bfloat16, torch.float32))
    check_inner_contiguous(name, "x", x, 1)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"{name}: group_size must be a power of two >= 16, got {group_size}")
    m, k = x.shape
    num_groups = cdiv(k, group_size)
    q = scratch((m, k), FP8_DTYPE, x.device)  # [M, K]
    scale = scratch((m, num_groups), torch.float32, x.device)  # [M, num_groups]
    if m == 0 or k == 0:
        return q, scale
    block_rows = min(16, next_pow2(m))
    launch(
        _act_quant_kernel,
        (triton.cdiv(m, block_rows), num_groups),
        x,
        q,
        scale,
        m,
        x.stride(0),
        K=k,
        NUM_GROUPS=num_groups,
        GROUP=group_size,
        BLOCK_ROWS=block_rows,
    )
    return q, scale
