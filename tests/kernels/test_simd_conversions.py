"""kernels/csrc/simd.h's one rounding rule, for each build this machine can run (native, AVX-512
without AVX512-BF16, AVX2 only, scalar): float32 -> bfloat16 rounds to nearest even as torch's
.to(torch.bfloat16) does (subnormals rounded, never flushed; a NaN keeps its sign and top payload
with the quiet bit set), bfloat16 and float16 widen exactly, and the vector forms give the scalar
build's bits on ties, NaNs, infinities, subnormals and the largest floats. Checked on simd.h itself
(through simd_conversions.c, built here) and on the bfloat16 outputs of the dequantizers, whose
vector stores once flushed subnormals (AVX512-BF16) and turned NaNs into infinities or -0 (AVX2)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest
import torch
from kernel_testing import C_BUILDS
from test_group_dequantize_kernels import pack_int4

from moemesh.kernels import c_library
from moemesh.kernels import group_gemv as gg

SOURCE = Path(__file__).with_name("simd_conversions.c")
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c")  # no AVX512-BF16
BUILDS = {**C_BUILDS, "avx512": AVX512}
# float32 bit patterns: ties (down to even, up to even, negative), either side of a tie, NaNs, infinities, zeros,
# subnormals (ties among them), the smallest normal, the largest floats (the first rounds up to infinity)
EDGES = """3F808000 3F818000 BF808000 BF818000 3F808001 3F807FFF 7FC00000 7F800001 7FFFFFFF FFFFFFFF FF800001 7FBFFFFF
           7FC0FFFF 7F800000 FF800000 00000000 80000000 00000001 00008000 00018000 00007FFF 00400000 007FFFFF 807F8000
           80018000 00800000 7F7FFFFF 7F7F7FFF 7F7F8000 FF7FFFFF"""
NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma", "f16c"}}


def _needs(build: str) -> None:
    if not NEEDS.get(build, set()) <= set(c_library.cpu_flags().split()):
        pytest.skip(f"this CPU lacks {build}")


@functools.cache
def _library(build: str) -> ctypes.CDLL:
    lib = c_library.compile_library(SOURCE, BUILDS[build], "no conversions to test")
    if lib is None:
        pytest.skip("no C compiler here")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.to_bf16.argtypes = [ptr, ptr, i64, i32]
    lib.from_bf16.argtypes = lib.from_half.argtypes = [ptr, ptr, i64]
    lib.any_unsafe.argtypes = lib.any_unsafe_bf16.argtypes = lib.any_unsafe_half.argtypes = [ptr, i64]
    lib.hsums.argtypes = [ptr, ptr]
    return lib


def _bits_to_float(bits: list[int] | torch.Tensor) -> torch.Tensor:  # uint32 patterns -> float32
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _edge_floats() -> torch.Tensor:
    """EDGES, then every bfloat16 with the low halves that decide its rounding, then some EDGES again
    after an odd count, so that the values meet vector lanes and the scalar tail."""
    edges = [int(h, 16) for h in EDGES.split()]
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    every = (high[:, None] | lows[None, :]).reshape(-1)
    bits = torch.cat((torch.tensor(edges), every, torch.tensor(edges[:7])))
    return _bits_to_float(bits)


def _bf16_rule(x: torch.Tensor) -> torch.Tensor:  # float32 -> the rule's bfloat16 bits (int32)
    """torch's .to(bfloat16) (round to nearest even) where x is a number; a NaN: its high half with
    the quiet bit set (torch writes its own NaN there)."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return torch.where(torch.isnan(x), (u >> 16) | 0x40, rounded)


def _to_bf16(lib: ctypes.CDLL, x: torch.Tensor, form: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.int16)
    lib.to_bf16(x.data_ptr(), out.data_ptr(), x.numel(), form)
    return out.to(torch.int64) & 0xFFFF


@pytest.mark.parametrize("build", list(BUILDS))
def test_float32_to_bfloat16_follows_torchs_rounding_and_the_scalar_builds_bits(build):
    _needs(build)
    lib, scalar = _library(build), _library("scalar")
    x = _edge_floats()
    expected = _bf16_rule(x)
    reference = _to_bf16(scalar, x, 0)
    assert torch.equal(reference, expected)
    for form in (0, 2):  # simd_store_bf16, simd_bf16_bits
        assert torch.equal(_to_bf16(lib, x, form), expected), (build, form)
    u = x.view(torch.int32) & 0x7FFFFFFF
    normal = x[((u == 0) | (u >= 0x00800000)) & (u <= 0x7F800000)]  # the _normal form's inputs: no subnormal, no NaN
    assert torch.equal(_to_bf16(lib, normal, 1), _bf16_rule(normal))


@pytest.mark.parametrize("build", list(BUILDS))
def test_bfloat16_and_float16_widen_exactly_and_float16_nans_come_back_quiet(build):
    _needs(build)
    lib = _library(build)
    halves = torch.arange(1 << 16, dtype=torch.int64).to(torch.int16)
    widened = torch.empty(1 << 16, dtype=torch.float32)
    lib.from_bf16(halves.data_ptr(), widened.data_ptr(), 1 << 16)
    shifted = (halves.to(torch.int64) & 0xFFFF) << 16  # a bfloat16 is a float32's high half, NaNs as they are
    assert torch.equal(widened.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, shifted)
    lib.from_half(halves.data_ptr(), widened.data_ptr(), 1 << 16)
    h = halves.view(torch.float16)
    got = widened.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exact = h.to(torch.float64).to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    number = ~torch.isnan(h)
    assert torch.equal(got[number], exact[number])
    u = halves.to(torch.int64) & 0xFFFF
    quiet = ((u & 0x8000) << 16) | 0x7FC00000 | ((u & 0x3FF) << 13)  # F16C's NaN: payload kept, quiet bit set
    assert torch.equal(got[~number], quiet[~number])


@pytest.mark.parametrize("build", ["native", "scalar"])
def test_any_unsafe_scale_finds_the_scales_that_can_give_subnormal_or_nan_weights(build):
    """Unsafe: nonzero below 2^-102 in magnitude, infinite or NaN, for float32, bfloat16 and
    float16 scales; one unsafe value anywhere in an array makes it unsafe."""
    lib = _library(build)
    checks = {torch.float32: lib.any_unsafe, torch.bfloat16: lib.any_unsafe_bf16, torch.float16: lib.any_unsafe_half}
    for dtype, check in checks.items():
        if dtype == torch.float32:
            values = _edge_floats()[::7].contiguous()
        else:
            values = torch.arange(1 << 16, dtype=torch.int64).to(torch.int16).view(dtype)
        magnitude = values.double().abs()
        unsafe = ((magnitude > 0) & (magnitude < 2.0**-102)) | ~torch.isfinite(magnitude)
        single = torch.tensor([check(values[i : i + 1].data_ptr(), 1) for i in range(values.numel())])
        assert torch.equal(single.bool(), unsafe), dtype
        safe = values[~unsafe].contiguous()
        assert check(safe.data_ptr(), safe.numel()) == 0 and check(values.data_ptr(), values.numel()) == 1


@pytest.mark.parametrize("build", ["native", "avx2", "avx512"])
def test_hsum4_gives_each_vector_the_sum_hsum_gives_it_in_the_documented_order(build):
    _needs(build)
    lib = _library(build)
    lanes = lib.lanes()
    v = torch.randn(4 * lanes, generator=torch.Generator().manual_seed(3)) * torch.logspace(0, 6, 4 * lanes)
    out = torch.empty(5, dtype=torch.float32)
    lib.hsums(v.data_ptr(), out.data_ptr())
    blocks = v.view(4, lanes // 4, 4)  # [vector, 128-bit block, lane]
    block_sums = (blocks[..., 0] + blocks[..., 2]) + (blocks[..., 1] + blocks[..., 3])  # float32 adds
    if lanes == 16:
        expected = (block_sums[:, 0] + block_sums[:, 2]) + (block_sums[:, 1] + block_sums[:, 3])
    else:
        expected = block_sums[:, 0] + block_sums[:, 1]
    assert torch.equal(out[:4], expected) and torch.equal(out[4:], expected[:1])


@pytest.mark.parametrize("build", list(C_BUILDS))
def test_the_dequantizers_bfloat16_outputs_follow_the_rule_at_edge_scales(build):
    """w = 1 * scale: each weight is its scale, rounded by the kernel's bfloat16 store (vector or
    scalar, whichever the kernel picks for those scales)."""
    _needs(build)
    lib = gg.build(C_BUILDS[build])
    if lib is None:
        pytest.skip("no C compiler here")
    edges = _edge_floats()[:30]
    scale = torch.cat((edges, edges.flip(0))).view(-1, 2).repeat(1, 2).contiguous()  # [30, 4]: groups of 32
    codes = torch.ones(scale.shape[0], 128, dtype=torch.int8)
    expected = _bf16_rule(scale.repeat_interleave(32, dim=1))
    bits = lambda w: w.view(torch.int16).to(torch.int64) & 0xFFFF  # noqa: E731
    assert torch.equal(bits(gg.dequantize(codes, scale, None, torch.bfloat16, lib=lib)), expected)
    rows = torch.arange(scale.shape[0])  # row by row: rows without an unsafe scale take the vector stores
    assert torch.equal(bits(gg.dequantize(codes, scale, None, torch.bfloat16, rows, lib=lib)), expected)

    # int4pack: (9 - 8) * s + 0, with bfloat16 scales among them subnormal ones (the scalar loop) or
    # none (the vector stores)
    packed = pack_int4(torch.full((64, 128), 9, dtype=torch.int32), 64)
    with_subnormals = [0x0001, 0x0040, 0x807F, 0x7FC1, 0xFF81, 0x7F80, 0x7F7F, 0x3F80]
    without = [0x0080, 0x8080, 0x7FC1, 0xFF81, 0x7F80, 0xFF7F, 0x7F7F, 0x3F80]
    for s_bits in (with_subnormals, without):
        sz = torch.zeros(4, 64, 2, dtype=torch.int16)  # [G, N, (scale, zero)]
        sz[..., 0] = torch.tensor(s_bits * 8).to(torch.int16)
        w_t = gg.int4pack_dequantize(packed, sz.view(torch.bfloat16), 32, 64, lib=lib)  # [K, N]
        s = sz[0, :, 0].view(torch.bfloat16).float()
        assert torch.equal(bits(w_t), _bf16_rule(s)[None, :].expand(128, 64))
