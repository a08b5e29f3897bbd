"""The C group-quantized GEMV (kernels/csrc/group_gemv.c) against a float64 product with the weights
built independently (codes times scale plus min, per group), for each build this machine can run:
-march=native, AVX2 only, and no vector flags (the scalar loop)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_testing import C_BUILDS, built_library

from moemesh.kernels import c_library, group_quant
from moemesh.kernels import group_gemv as gg

BUILDS = C_BUILDS
N = 40


def _library(build: str):
    return built_library(gg.build, build)


def _weight(layout: str, k: int, group: int, scale_dtype: torch.dtype, with_mins: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_groups = k // group
    if layout == "int8":
        codes = torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=gen)
    else:
        codes = torch.randint(0, 16, (N, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(N, num_groups, generator=gen) * 1e-2).to(scale_dtype)
    mins = (torch.randn(N, num_groups, generator=gen) * 1e-2).to(scale_dtype) if with_mins else None
    w = codes.double().view(N, num_groups, group) * scale.double()[..., None]
    if mins is not None:
        w = w + mins.double()[..., None]
    stored = codes if layout == "int8" else group_quant.nibbles_from_codes(codes)
    return stored, scale, mins, w.view(N, k)


CASES = [  # layout, K, group, scale dtype, mins
    ("int8", 576, 32, torch.float16, False),  # Q8_0
    ("int8", 512, 16, torch.float32, False),  # Q6_K
    ("nibbles", 576, 32, torch.float16, True),  # Q4_1
    ("nibbles", 512, 32, torch.float32, True),  # Q4_K
    ("nibbles", 96, 32, torch.float16, False),
    ("int8", 48, 48, torch.float32, False),  # a group no vector path takes: the scalar loop
]


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("layout,k,group,scale_dtype,with_mins", CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 11])  # 11: more rows than one call takes (8 + 3)
def test_matches_the_float64_product_within_float32_rounding(build, layout, k, group, scale_dtype, with_mins, m):
    lib = _library(build)
    codes, scale, mins, w = _weight(layout, k, group, scale_dtype, with_mins)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    y = gg.group_gemv(x, codes, scale, mins, lib=lib)
    assert y.dtype == torch.float32 and y.shape == (m, N)
    bound = (x.double().abs() @ w.abs().T) * 1e-6 + 1e-30  # a few float32 ulps of the summed magnitudes
    assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


def test_bfloat16_input_is_read_as_its_float32_value():
    lib = _library("native")
    codes, scale, mins, w = _weight("nibbles", 576, 32, torch.float16, True)
    x = torch.randn(2, 576).bfloat16()
    torch.testing.assert_close(
        gg.group_gemv(x, codes, scale, mins, lib=lib),
        gg.group_gemv(x.float(), codes, scale, mins, lib=lib),
        rtol=0,
        atol=0,
    )


def test_nibble_layout_round_trips_and_follows_ggufs_order():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = group_quant.nibbles_from_codes(codes)
    assert packed.shape == (3, 32) and torch.equal(group_quant.codes_from_nibbles(packed), codes)
    assert torch.equal(packed[:, :16] & 0x0F, codes[:, :16]) and torch.equal(packed[:, :16] >> 4, codes[:, 16:32])


def test_bad_shapes_and_dtypes_are_refused_with_a_message():
    lib = _library("native")
    codes, scale, mins, _ = _weight("nibbles", 64, 32, torch.float16, True)
    with pytest.raises(ValueError, match="codes"):
        gg.group_gemv(torch.randn(1, 96), codes, scale, mins, lib=lib)
    with pytest.raises(ValueError, match="one dtype"):
        gg.group_gemv(torch.randn(1, 64), codes, scale, mins.float(), lib=lib)
    with pytest.raises(ValueError, match="contiguous"):
        gg.group_gemv(torch.randn(1, 64), codes, scale.T.contiguous().T, mins, lib=lib)
    int8_codes, s, _, _ = _weight("int8", 64, 16, torch.float32, False)
    with pytest.raises(ValueError, match="unsupported"):  # nibbles need groups of 32
        gg.group_gemv(
            torch.randn(1, 64),
            group_quant.nibbles_from_codes(int8_codes.abs().clamp(max=15).to(torch.uint8)),
            s,
            lib=lib,
        )


@pytest.mark.parametrize("broken", ["compiler", "cache_dir"])
def test_a_missing_compiler_or_an_unwritable_cache_gives_none_and_a_log_line(monkeypatch, tmp_path, caplog, broken):
    if broken == "compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("MOEMESH_CACHE_DIR", str(tmp_path))
    else:
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("MOEMESH_CACHE_DIR", str(tmp_path / "file"))  # a file where a directory must go
    gg.build.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=gg.__name__):
            assert gg.build(("-DMOEMESH_TEST_BROKEN_BUILD",)) is None
        assert "failed" in caplog.text
    finally:
        gg.build.cache_clear()


def _large_int8_product(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, 576], Q8_0-like codes [2048, 576] and float16 scales: a weight large enough to split."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (2048, 576), dtype=torch.int8, generator=gen)
    return torch.randn(rows, 576, generator=gen), codes, torch.rand(2048, 18, generator=gen).half()


def test_large_weights_split_their_rows_over_torchs_threads_with_the_same_result(monkeypatch):
    lib = _library("native")
    assert gg._row_ranges(2048, 2048 * 576, 3) == [(0, 682), (682, 1365), (1365, 2048)]
    assert gg._row_ranges(2048, 1000, 3) == [(0, 2048)]  # small: one thread
    x, codes, scale = _large_int8_product(3, 3)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = gg.group_gemv(x, codes, scale, lib=lib)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(gg.group_gemv(x, codes, scale, lib=lib), one)  # each row is summed the same way


def test_parts_run_on_torchs_openmp_runtime_and_serially_where_the_compiler_has_none(monkeypatch, tmp_path, caplog):
    """The NAME_parts entry points (c_parts.h) link libgomp.so.1, which resolves to the copy torch
    loaded (one OpenMP runtime in the process: one pool of threads); a compiler that refuses
    -fopenmp builds them serial, logged, with the same rows."""
    lib = _library("native")
    gomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(gomp) <= 1, gomp
    x, codes, scale = _large_int8_product(4, 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    threaded = gg.group_gemv(x, codes, scale, lib=lib)
    monkeypatch.setattr(c_library, "OPENMP_FLAGS", ("-fno-such-openmp-flag",))
    monkeypatch.setenv("MOEMESH_CACHE_DIR", str(tmp_path))
    gg.build.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=c_library.__name__):
            serial = gg.build(gg.NATIVE_FLAGS)
        assert serial is not None and "trying without OpenMP" in caplog.text
        assert torch.equal(gg.group_gemv(x, codes, scale, lib=serial), threaded)
    finally:
        gg.build.cache_clear()
