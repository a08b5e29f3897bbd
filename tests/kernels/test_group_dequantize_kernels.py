"""The C dequantizers of kernels/csrc/group_gemv.c against weights built independently in float64, for
each build this machine can run (-march=native, AVX2 only, scalar):

- `dequantize` (GGUF's int8 / nibble layouts, what rounds above the GEMV's few rows and quantized
  embeddings read): code * scale (+ min) is exact in float64 and in float32, so the result must
  equal the float64 weight rounded to float32 (then to bfloat16), bit for bit;
- `int4pack_dequantize` (PyTorch's CPU int4pack layout, the bf16 4-bit weights' large rounds):
  (q - 8) * scale + zero, likewise bit for bit, read from torch's own packing and from a layout
  built here for both block widths (64 rows with AVX-512, 32 with AVX2).
"""

from __future__ import annotations

import pytest
import torch
from test_group_gemv_kernels import BUILDS, N, _library, _weight

from moemesh.kernels import group_gemv as gg

CASES = [  # layout, K, group, scale dtype, mins
    ("int8", 576, 32, torch.float16, False),  # Q8_0
    ("int8", 512, 16, torch.float32, False),  # Q6_K
    ("nibbles", 576, 32, torch.float16, True),  # Q4_1
    ("nibbles", 512, 32, torch.float32, True),  # Q4_K
    ("nibbles", 96, 32, torch.float16, False),  # Q4_0 without its min
    ("int8", 48, 48, torch.float32, True),  # a group no vector path takes: the scalar loop
]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("layout,k,group,scale_dtype,with_mins", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rounds_the_exact_weight_once(build, layout, k, group, scale_dtype, with_mins, dtype):
    lib = _library(build)
    codes, scale, mins, w = _weight(layout, k, group, scale_dtype, with_mins)
    expected = w.float().to(dtype)
    assert torch.equal(gg.dequantize(codes, scale, mins, dtype, lib=lib), expected)
    assert torch.equal(gg.dequantize(codes, scale, mins, dtype, slice(7, 23), lib=lib), expected[7:23])
    ids = torch.tensor([N - 1, 0, 5, 5])
    assert torch.equal(gg.dequantize(codes, scale, mins, dtype, ids, lib=lib), expected[ids])
    out = torch.full((3, k), float("nan"), dtype=dtype)
    assert gg.dequantize(codes, scale, mins, dtype, slice(2, 5), out=out, lib=lib) is out
    assert torch.equal(out, expected[2:5])


def test_dequantize_refuses_bad_rows_and_outputs():
    lib = _library("native")
    codes, scale, mins, _ = _weight("nibbles", 64, 32, torch.float16, True)
    with pytest.raises(IndexError, match="out of range"):
        gg.dequantize(codes, scale, mins, torch.float32, torch.tensor([0, N]), lib=lib)
    with pytest.raises(IndexError, match="out of range"):
        gg.dequantize(codes, scale, mins, torch.float32, torch.tensor([-1]), lib=lib)
    with pytest.raises(ValueError, match="contiguous"):
        gg.dequantize(codes, scale, mins, torch.float32, slice(0, 8, 2), lib=lib)
    with pytest.raises(ValueError, match="expected"):
        gg.dequantize(codes, scale, mins, torch.float32, slice(0, 4), out=torch.empty(4, 64).bfloat16(), lib=lib)
    with pytest.raises(ValueError, match="float16"):
        gg.dequantize(codes, scale, mins, torch.float16, lib=lib)
    assert gg.dequantize(codes, scale, mins, torch.float32, torch.tensor([], dtype=torch.int64), lib=lib).shape == (
        0,
        64,
    )


def test_dequantize_splits_large_weights_over_torchs_threads_with_the_same_result(monkeypatch):
    lib = _library("native")
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-128, 128, (2048, 576), dtype=torch.int8, generator=gen)
    scale = torch.rand(2048, 18, generator=gen).half()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = gg.dequantize(codes, scale, None, torch.bfloat16, lib=lib)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(gg.dequantize(codes, scale, None, torch.bfloat16, lib=lib), one)


def pack_int4(codes: torch.Tensor, block_n: int) -> torch.Tensor:  # [N, K] 0..15 -> [N, K / 2] uint8
    """PyTorch's CPU int4pack layout, written out: per block of block_n rows, per column, block_n / 2
    bytes, byte j holding row j (low nibble) and row block_n / 2 + j (high nibble)."""
    n, k = codes.shape
    half = block_n // 2
    blocks = codes.to(torch.uint8).view(n // block_n, 2, half, k)  # [blocks, low/high, j, k]
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [blocks, j, k]
    return packed.transpose(1, 2).contiguous().view(n, k // 2)  # bytes in (block, k, j) order


def _int4_weight(n: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales_zeros = (torch.randn(k // group, n, 2, generator=gen) * 1e-2).bfloat16()  # [G, N, (scale, zero)]
    s = scales_zeros[..., 0].double().T.repeat_interleave(group, dim=1)  # [N, K]
    z = scales_zeros[..., 1].double().T.repeat_interleave(group, dim=1)
    return codes, scales_zeros, (codes.double() - 8) * s + z  # exact in float64


def test_torchs_int4pack_layout_here_is_the_one_written_out_and_is_detected():
    """ATen packs 64-row blocks where it dispatches to AVX-512, 32 with AVX2, and pairs of rows
    (not read here: None) otherwise."""
    if gg.library() is None:
        pytest.skip("no C compiler here")
    expected = {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())
    assert gg.int4pack_block_n() == expected
    if expected is not None:
        codes = torch.randint(0, 16, (256, 128), dtype=torch.int32)
        assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), pack_int4(codes, expected))


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("k,group", [(576, 32), (512, 128), (96, 32)])
def test_int4pack_dequantize_rounds_the_exact_weight_once(build, block_n, k, group):
    lib = _library(build)
    n = 4 * block_n
    codes, scales_zeros, w = _int4_weight(n, k, group)
    packed = pack_int4(codes, block_n)
    expected = w.float().bfloat16()  # [N, K]
    w_t = gg.int4pack_dequantize(packed, scales_zeros, group, block_n, lib=lib)
    assert w_t.shape == (k, n) and w_t.dtype == torch.bfloat16 and torch.equal(w_t.T, expected)
    part = gg.int4pack_dequantize(packed, scales_zeros, group, block_n, slice(block_n, 3 * block_n), lib=lib)
    assert torch.equal(part.T, expected[block_n : 3 * block_n])


def test_int4pack_dequantize_times_x_matches_torchs_int4pack_kernel():
    if gg.library() is None or gg.int4pack_block_n() is None:
        pytest.skip("no C compiler or an unknown int4pack layout here")
    codes, scales_zeros, w = _int4_weight(192, 576, 32, seed=1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    x = torch.randn(16, 576).bfloat16()
    ours = x.float() @ gg.int4pack_dequantize(packed, scales_zeros, 32).float()
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros).float()
    exact = x.double() @ w.T
    bound = (x.double().abs() @ w.abs().T) * 2e-2  # bf16 rounding of the weight and of the kernel's output
    assert ((ours.double() - exact).abs() <= bound).all() and ((theirs.double() - exact).abs() <= bound).all()


def test_int4pack_dequantize_refuses_shapes_it_cannot_read():
    lib = _library("native")
    codes, scales_zeros, _ = _int4_weight(128, 64, 32)
    packed = pack_int4(codes, 64)
    with pytest.raises(ValueError, match="unsupported"):  # columns not on block boundaries
        gg.int4pack_dequantize(packed, scales_zeros, 32, 64, slice(32, 128), lib=lib)
    with pytest.raises(ValueError, match="scales_zeros"):
        gg.int4pack_dequantize(packed, scales_zeros.float(), 32, 64, lib=lib)
    with pytest.raises(ValueError, match="out"):
        gg.int4pack_dequantize(packed, scales_zeros, 32, 64, out=torch.empty(128, 64).bfloat16(), lib=lib)
