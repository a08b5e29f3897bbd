"""Factories and tolerances shared by the kernel tests (imported as a plain module)."""

import pytest
import torch

from moemesh.kernels import c_library

# fp32 within ~1e-5; bf16 within ~1e-2 (plus one bf16 ulp: the interpreter truncates bf16 casts).
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def assert_close_f64(actual: torch.Tensor, expected_f64: torch.Tensor, dtype: torch.dtype) -> None:
    """actual (in dtype) against a float64 oracle; NaN anywhere fails."""
    assert not torch.isnan(actual).any(), "output has NaN: an element was not written"
    torch.testing.assert_close(actual.double(), expected_f64, **TOLERANCES[dtype])


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def random_block_tables(context_lens: list[int], block_size: int, max_num_blocks: int, num_blocks: int) -> torch.Tensor:
    """[num_reqs, max_num_blocks] int32: distinct shuffled physical blocks, padded with block 0."""
    perm = torch.randperm(num_blocks - 1) + 1  # block 0 = the null block used for padding
    tables = torch.zeros(len(context_lens), max_num_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(context_lens):
        needed = -(-n // block_size)
        tables[i, :needed] = perm[used : used + needed]
        used += needed
    assert used <= num_blocks - 1
    return tables


def gather_positions(cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Token rows 0..length-1 of one request, gathered one position at a time (float64)."""
    rows = [cache[int(block_table[p // block_size]), p % block_size] for p in range(length)]
    return torch.stack(rows).double() if rows else cache.new_zeros((0, *cache.shape[2:])).double()


# the builds of a C kernel library a test runs where this machine can: -march=native, AVX2 only,
# and no vector flags (the scalar loops)
C_BUILDS = {"native": c_library.NATIVE_FLAGS, "avx2": ("-mavx2", "-mfma", "-mf16c"), "scalar": ()}


def built_library(build_fn, build: str):
    """`build_fn(flags)` (a kernel module's `build`) for one of C_BUILDS; skips where this CPU
    lacks the build's flags or no compiler is found."""
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= set(c_library.cpu_flags().split()):
        pytest.skip("this CPU lacks AVX2/FMA/F16C")
    lib = build_fn(C_BUILDS[build])
    if lib is None:
        pytest.skip("no C compiler here")
    return lib
