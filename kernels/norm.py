"""RMSNorm, with an optional fused residual add (the pre-norm transformer pattern)."""

import torch

from moemesh.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_dtype,
    check_launchable,
    check_shape,
    launch,
    next_pow2,
    scratch,
    tl,
    triton,
)


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    xf = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], eps=eps)  # x * rsqrt(mean(x^2) + eps), float32
    return xf.to(x.dtype) * weight  # cast, then scale, as Hugging Face's Llama does


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [num_tokens, hidden], dense rows
        residual_ptr,  # [num_tokens, hidden]; read only when HAS_RESIDUAL
        weight_ptr,  # [hidden]
        out_ptr,  # [num_tokens, hidden], contiguous
        summed_ptr,  # [num_tokens, hidden], contiguous; written only when HAS_RESIDUAL
        x_row_stride,
        residual_row_stride,
        eps,
        HIDDEN: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's x + residual
            tl.store(summed_ptr + row * HIDDEN + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * HIDDEN + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as [num_rows, hidden] with dense rows (a view when possible, else a copy)."""
    rows = t.reshape(-1, hidden)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rms_norm_launch(name, x, residual, weight, eps):
    check_launchable(name, *(t for t in (x, residual, weight) if t is not None))
    hidden = x.shape[-1]
    check_shape(name, "weight", weight, (hidden,))
    check_dtype(name, "x", x, FLOAT_DTYPES)
    check_dtype(name, "weight", weight, FLOAT_DTYPES)
    if residual is not None:
        check_shape(name, "residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    rows = _rows(x, hidden)  # [num_rows, hidden]
    res_rows = _rows(residual, hidden) if residual is not None else rows
    out = scratch(tuple(x.shape), x.dtype, x.device)  # [..., hidden]
    summed = scratch(tuple(x.shape), x.dtype, x.device) if residual is not None else out
    if rows.shape[0] > 0:
        launch(
            _rms_norm_kernel,
            (rows.shape[0],),
            rows,
            res_rows,
            weight.contiguous(),
            out,
            summed,
            rows.stride(0),
            res_rows.stride(0),
            float(eps),
            HIDDEN=hidden,
            BLOCK=next_pow2(hidden),
            HAS_RESIDUAL=residual is not None,
            num_warps=8 if hidden >= 4096 else 4,
        )
    return out, summed


def rms_norm_triton(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], x.dtype
    """rms_norm_ref on the GPU: one program per row, the whole row in one tile."""
    return _rms_norm_launch("rms_norm_triton", x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm_ref on the GPU: (rms_norm(x + residual), x + residual) in one pass."""
    return _rms_norm_launch("fused_add_rms_norm_triton", x, residual, weight, eps)
