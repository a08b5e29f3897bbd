"""4- and 8-bit codes in row blocks (kernels/csrc/code_blocks.h through group_gemv.c): the 4-bit layout
against ATen's int4pack packing, the GEMV and the GEMM against a float64 product, and the row
gather against the float64 weights rounded once to float32; for each build this machine can run
(native, AVX2 only, scalar) and row blocks the vector loops read (4 vectors) or not."""

from __future__ import annotations

import pytest
import torch
from test_group_gemv_kernels import _library

from moemesh.kernels import group_gemv as gg
from moemesh.kernels import group_quant

BUILDS = ("native", "avx2", "scalar")


def _weight(
    n: int, k: int, group: int, scale_dtype: torch.dtype, with_mins: bool, block_n: int, seed: int = 0, bits: int = 4
):
    """(packed, scale [G, N], mins [G, N] or None, W [N, K] float64) built from random codes."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(k // group, n, generator=gen) * 1e-2).to(scale_dtype)
    mins = (torch.randn(k // group, n, generator=gen) * 1e-2).to(scale_dtype) if with_mins else None
    w = codes.double().view(n, k // group, group) * scale.double().t()[..., None]
    if mins is not None:
        w = w + mins.double().t()[..., None]
    return group_quant.blocks_from_codes(codes, block_n, bits), scale, mins, w.view(n, k)


def test_the_layout_round_trips_and_is_atens_int4pack_code_order():
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32)
    for block_n in (16, 32, 64):
        packed = group_quant.blocks_from_codes(codes, block_n)
        assert packed.shape == (128, 32) and torch.equal(group_quant.codes_from_blocks(packed, block_n), codes.byte())
        first = packed.view(-1)[: block_n // 2]  # column 0 of the first block
        assert torch.equal(first & 0x0F, codes[: block_n // 2, 0].byte())
        assert torch.equal(first >> 4, codes[block_n // 2 : block_n, 0].byte())
    aten_block = gg.int4pack_block_n()
    if aten_block is not None:
        aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        assert torch.equal(aten, group_quant.blocks_from_codes(codes, aten_block))
    signed = torch.randint(-128, 128, (128, 64), dtype=torch.int8)
    packed = group_quant.blocks_from_codes(signed, 32, bits=8)  # 8-bit: column k of a block is 32 bytes, row j's at j
    assert packed.dtype == torch.int8 and torch.equal(packed.view(-1)[:32], signed[:32, 0])
    assert torch.equal(group_quant.codes_from_blocks(packed, 32), signed)


CASES = [  # bits, K, group, scale dtype, mins
    (4, 576, 32, torch.float16, True),  # Q4_1
    (4, 512, 32, torch.float32, True),  # Q4_K (float32 products of its two scales)
    (4, 96, 32, torch.float16, False),
    (4, 144, 48, torch.float32, True),  # a group that is not a multiple of 32
    (8, 576, 32, torch.float16, False),  # Q8_0
    (8, 512, 16, torch.float32, False),  # Q6_K
    (8, 96, 48, torch.float16, True),
]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("bits,k,group,scale_dtype,with_mins", CASES)
def test_gemv_and_gemm_match_the_float64_product_within_float32_rounding(
    build, block_n, bits, k, group, scale_dtype, with_mins
):
    lib = _library(build)
    packed, scale, mins, w = _weight(128, k, group, scale_dtype, with_mins, block_n, bits=bits)
    # the GEMM: partial tiles of 6 (AVX-512) or 3 (AVX2) rows, and K past one 128-column slice
    for multiply, rows in ((gg.blocks_gemv, (1, 3, 8)), (gg.blocks_gemm, (1, 5, 13, 64))):
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = multiply(x, packed, scale, mins, block_n, lib=lib)
            assert y.dtype == torch.float32 and y.shape == (m, 128)
            bound = (x.double().abs() @ w.abs().T) * 1e-6 + 1e-30  # a few float32 ulps of the summed magnitudes
            assert ((y.double() - x.double() @ w.T).abs() <= bound).all(), (multiply.__name__, m)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("bits,k,group,scale_dtype,with_mins", CASES)
def test_gather_gives_the_weights_rounded_once_to_float32(build, block_n, bits, k, group, scale_dtype, with_mins):
    lib = _library(build)
    packed, scale, mins, w = _weight(192, k, group, scale_dtype, with_mins, block_n, bits=bits)
    exact = w.float()
    ids = torch.tensor([5, 0, 191, 5, block_n, block_n // 2])
    assert torch.equal(gg.blocks_gather(packed, scale, mins, block_n, ids, lib=lib), exact[ids])
    assert torch.equal(gg.blocks_gather(packed, scale, mins, block_n, slice(3, 40), lib=lib), exact[3:40])
    assert torch.equal(gg.blocks_gather(packed, scale, mins, block_n, lib=lib), exact)


@pytest.mark.parametrize("bits,k,group,scale_dtype,with_mins", CASES)
def test_the_bfloat16_gemm_matches_the_float64_product_of_the_bfloat16_weights(bits, k, group, scale_dtype, with_mins):
    """AVX512-BF16: bfloat16 x times W rounded to bfloat16, float32 sums (2 products a lane per
    instruction); elsewhere bfloat16 x is read in float32 (the float32 GEMM, W not rounded)."""
    lib = _library("native")
    packed, scale, mins, w = _weight(128, k, group, scale_dtype, with_mins, 64, bits=bits)
    weights = w.float().bfloat16().double() if gg.blocks_bf16_gemm(lib) else w
    for m in (1, 5, 13, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = gg.blocks_gemm(x, packed, scale, mins, 64, lib=lib)
        assert y.dtype == torch.float32 and y.shape == (m, 128)
        bound = (x.double().abs() @ weights.abs().T) * 1e-6 + 1e-30
        assert ((y.double() - x.double() @ weights.T).abs() <= bound).all(), m


@pytest.mark.parametrize("bits", [4, 8])
def test_two_threads_give_the_bits_of_one(bits):
    lib = _library("native")
    block_n = gg.blocks_block_n(lib) or 32
    packed, scale, mins, _ = _weight(
        1024, 576, 32, torch.float16, True, block_n, bits=bits
    )  # past PARALLEL_MIN_WEIGHTS
    x = torch.randn(3, 576)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(
                (
                    gg.blocks_gemv(x, packed, scale, mins, block_n, lib=lib),
                    gg.blocks_gemm(
                        torch.randn(40, 576, generator=torch.Generator().manual_seed(0)),
                        packed,
                        scale,
                        mins,
                        block_n,
                        lib=lib,
                    ),
                    gg.blocks_gather(packed, scale, mins, block_n, torch.arange(200), lib=lib),
                )
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_bad_shapes_rows_and_dtypes_are_refused_with_a_message():
    lib = _library("native")
    packed, scale, mins, _ = _weight(64, 64, 32, torch.float16, True, 32)
    with pytest.raises(ValueError, match="x"):
        gg.blocks_gemv(torch.randn(1, 96), packed, scale, mins, 32, lib=lib)
    with pytest.raises(ValueError, match="blocks of 64"):
        gg.blocks_gemv(torch.randn(1, 64), packed[:32], scale[:, :32], mins[:, :32], 64, lib=lib)
    with pytest.raises(ValueError, match="one dtype"):
        gg.blocks_gemv(torch.randn(1, 64), packed, scale, mins.float(), 32, lib=lib)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        gg.blocks_gemm(torch.randn(4, 64).half(), packed, scale, mins, 32, lib=lib)
    with pytest.raises(IndexError):
        gg.blocks_gather(packed, scale, mins, 32, torch.tensor([0, 64]), lib=lib)
    with pytest.raises(ValueError, match="rows are not blocks"):
        group_quant.blocks_from_codes(torch.zeros(48, 64, dtype=torch.uint8), 32)
