import pytest
import torch
from kernel_testing import assert_close_f64

from moemesh.kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref, rms_norm_triton

HIDDEN, EPS = 40, 1e-5  # hidden not a power of two: the kernel's tile is masked


def _naive_rms_norm(x, weight):
    rows = x.double().reshape(-1, HIDDEN)
    out = torch.empty_like(rows)
    for i, row in enumerate(rows):
        out[i] = row / (sum(v * v for v in row.tolist()) / HIDDEN + EPS) ** 0.5 * weight.double()
    return out.view(x.shape)


def _inputs(dtype):
    wide = torch.randn(6, 2 * HIDDEN, dtype=dtype)
    x = wide[:, 3 : 3 + HIDDEN]  # strided rows, as a slice of a wider activation
    residual = torch.randn(6, HIDDEN, dtype=dtype)
    weight = torch.randn(HIDDEN)  # float32 parameters with bf16 activations, as the engine has them
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_matches_the_float64_oracle_on_2d_and_3d_inputs(dtype):
    x, _, weight = _inputs(dtype)
    assert_close_f64(rms_norm_triton(x, weight, EPS), _naive_rms_norm(x, weight), dtype)
    heads = torch.randn(3, 4, HIDDEN, dtype=dtype)  # per-head q/k norm: [num_tokens, num_heads, head_dim]
    assert_close_f64(rms_norm_triton(heads, weight, EPS), _naive_rms_norm(heads, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(dtype):
    x, residual, weight = _inputs(dtype)
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, EPS)
    # The residual stream is x + residual rounded to dtype: exactly torch's add on the GPU; the
    # interpreter truncates instead of rounding bf16, so there it may be one ulp (2**-7) lower.
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(summed, x + residual, **exact)
    assert_close_f64(normed, _naive_rms_norm(x + residual, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_match_the_float64_oracle(dtype):
    x, residual, weight = _inputs(dtype)
    assert_close_f64(rms_norm_ref(x, weight, EPS), _naive_rms_norm(x, weight), dtype)
    normed, summed = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)
    assert_close_f64(normed, _naive_rms_norm(x + residual, weight), dtype)


def test_triton_rms_norm_rejects_a_weight_of_the_wrong_size_and_a_residual_of_another_dtype():
    x, residual, weight = _inputs(torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_triton(x, weight[:-1], EPS)
    with pytest.raises(ValueError, match="residual dtype"):
        fused_add_rms_norm_triton(x, residual.bfloat16(), weight, EPS)
