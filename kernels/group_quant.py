"""Group-quantized weights in plain torch: the code layouts the C kernels read and references of
the group GEMV and dequantization (the paths dispatch.py takes where the C library is not built or
the tensors are not on the CPU).

W[n, g * group + j] = scale[n, g] * q[n, g, j] (+ mins[n, g]), codes int8 [N, K] (GGUF's Q8_0,
Q6_K) or 4-bit nibbles uint8 [N, K / 2] in GGUF's own order (group_gemv.c's layout), scale and
mins [N, G] float16 or float32. Code blocks (code_blocks.h) keep the codes in row blocks, with
scales [G, N].
"""

from __future__ import annotations

import torch


def nibbles_from_codes(codes: torch.Tensor) -> torch.Tensor:  # [N, K] 0..15 -> [N, K / 2] uint8
    """group_gemv.c's nibble layout: per 32 columns, byte j = column j | column j + 16 << 4."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def codes_from_nibbles(packed: torch.Tensor) -> torch.Tensor:  # [R, K / 2] uint8 -> [R, K] uint8
    r, half = packed.shape
    p = packed.view(r, half // 16, 1, 16)
    return torch.cat((p & 0x0F, p >> 4), dim=2).reshape(r, half * 2)


def blocks_from_codes(codes: torch.Tensor, block_n: int, bits: int = 4) -> torch.Tensor:
    """[N, K] codes (0..15 for 4 bits, int8 for 8) in row blocks: per block of block_n rows, per
    column, block_n / 2 bytes (byte j = row j | row block_n / 2 + j << 4) or block_n bytes."""
    n, k = codes.shape
    if n % block_n or block_n % 2 or bits not in (4, 8):
        raise ValueError(f"code blocks: {n} rows are not blocks of {block_n}, or {bits} bits")
    if bits == 8:
        return codes.to(torch.int8).view(n // block_n, block_n, k).transpose(1, 2).reshape(n, k).contiguous()
    c = codes.to(torch.uint8).view(n // block_n, 2, block_n // 2, k).permute(0, 3, 1, 2)  # [NB, K, 2, half]
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def codes_from_blocks(packed: torch.Tensor, block_n: int) -> torch.Tensor:  # -> [N, K] uint8 (4-bit) or int8
    if packed.dtype == torch.int8:
        n, k = packed.shape
        return packed.view(n // block_n, k, block_n).transpose(1, 2).reshape(n, k)
    n, half_k = packed.shape
    p = packed.view(n // block_n, half_k * 2, 1, block_n // 2)  # [NB, K, 1, half]
    return torch.cat((p & 0x0F, p >> 4), dim=2).permute(0, 2, 3, 1).reshape(n, half_k * 2)


def group_dequantize_ref(
    codes: torch.Tensor,  # [N, K] int8, or [N, K / 2] uint8 nibbles
    scale: torch.Tensor,  # [N, K // group] float32 or float16
    mins: torch.Tensor | None,  # like scale, or None
    dtype: torch.dtype,
    rows: slice | torch.Tensor = slice(None),  # a range of rows, or row indices (a gather)
    out: torch.Tensor | None = None,  # [R, K] of `dtype`, contiguous
) -> torch.Tensor:  # [R, K]
    """Rows of W in `dtype`: code * scale (+ min) in float32, rounded to `dtype` as it is stored.
    GGUF's products of a code and a scale are exact in float32, so its weights come out as the C
    kernel's (which rounds one fused multiply-add)."""
    selected = codes[rows]
    if codes.dtype == torch.uint8:
        selected = codes_from_nibbles(selected)
    r, k = selected.shape
    q = selected.view(r, scale.shape[1], -1)  # [R, G, group]
    w = torch.empty(q.shape, dtype=dtype, device=codes.device) if out is None else out.view(q.shape)
    scales = scale[rows].float()[..., None]  # [R, G, 1]
    if mins is not None:
        torch.addcmul(mins[rows].float()[..., None], q, scales, out=w)
    else:
        torch.mul(q, scales, out=w)
    return w.view(r, k)


def group_gemv_ref(
    x: torch.Tensor,  # [M, K], any floating dtype
    codes: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] float32
    """y = x @ W^T in float32, W dequantized whole (group_gemv.c's function, summed in torch's order)."""
    return x.float() @ group_dequantize_ref(codes, scale, mins, torch.float32).T
