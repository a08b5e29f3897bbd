"""moemesh.kernels' front door to the C kernels: each dispatch function runs the C kernel where its
library is built and the torch reference (or says None, for the caller's numpy path) where it is
not, with the same values; and no code outside kernels/ imports a C loader module."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from test_group_gemv_kernels import _weight

import moemesh.kernels as kernels
from moemesh.kernels import cpu_moe, dispatch, group_gemv, llama_decode, moe_dispatch

ROOT = Path(__file__).resolve().parents[2]
LOADERS = {"c_library", "cpu_ops", "cpu_moe", "group_gemv", "llama_decode", "moe_dispatch"}


@pytest.fixture
def without_c(monkeypatch):
    """Every C library missing, as on a machine without a compiler."""
    for loader in (group_gemv, llama_decode, moe_dispatch, cpu_moe):
        monkeypatch.setattr(loader, "library", lambda: None)


WEIGHTS = [("int8", 576, 32, torch.float16, False), ("nibbles", 512, 32, torch.float32, True)]  # Q8_0, Q4_K


@pytest.mark.parametrize("layout,k,group,scale_dtype,with_mins", WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_dequantize_gives_the_same_bits_with_and_without_the_c_kernel(
    layout, k, group, scale_dtype, with_mins, dtype, monkeypatch
):
    if not kernels.quantized_kernels_built():
        pytest.skip("no C compiler here")
    codes, scale, mins, w = _weight(layout, k, group, scale_dtype, with_mins)
    rows = torch.tensor([3, 0, 7])
    with_c = [kernels.group_dequantize(codes, scale, mins, dtype, r) for r in (slice(None), rows)]
    monkeypatch.setattr(group_gemv, "library", lambda: None)
    assert not kernels.quantized_kernels_built()
    for r, c_out in zip((slice(None), rows), with_c):
        torch_out = kernels.group_dequantize(codes, scale, mins, dtype, r)
        assert torch.equal(torch_out, c_out) and torch.equal(torch_out, w.float().to(dtype)[r])


def test_quantized_gemv_agrees_with_and_without_the_c_kernel_within_float32_rounding(monkeypatch):
    codes, scale, mins, w = _weight("nibbles", 576, 32, torch.float16, True)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    bound = (x.double().abs() @ w.abs().T) * 1e-6
    outputs = [kernels.quantized_gemv(x, codes, scale, mins)]
    monkeypatch.setattr(group_gemv, "library", lambda: None)
    outputs.append(kernels.quantized_gemv(x, codes, scale, mins))
    for y in outputs:
        assert y.dtype == torch.float32 and ((y.double() - x.double() @ w.T).abs() <= bound).all()


def test_without_a_compiler_the_dispatch_says_none_and_the_builds_say_false(without_c):
    tables = kernels.LayerTables.build(None, np.ones(4), np.zeros(4))
    ids, weights = torch.tensor([[0, 3], [1, 0]]), torch.rand(2, 2)
    assert kernels.plan_expert_dispatch(tables, ids, weights) is None
    one = np.array([0], dtype=np.int32)
    assert kernels.check_expert_groups(one, one, one, one, 1, np.zeros(4, np.int64), np.arange(4)) is None
    assert not kernels.build_expert_dispatch_kernel() and not kernels.build_grouped_moe_kernel()
    assert not kernels.llama_decode_built() and not kernels.quantized_kernels_built()


def test_with_the_c_library_the_dispatch_plans_and_checks(monkeypatch):
    if not kernels.build_expert_dispatch_kernel():
        pytest.skip("no C compiler here")
    tables = kernels.LayerTables.build(None, np.ones(4), np.array([0, 0, 1, 1]))
    plan = kernels.plan_expert_dispatch(tables, torch.tensor([[0, 3], [2, 0]]), torch.rand(2, 2))
    assert isinstance(plan, kernels.DispatchPlan) and plan.batches[:, 0].tolist() == [0, 1]
    slots, experts, sizes = (np.array(v, dtype=np.int32) for v in ([0, 2], [0, 2], [1, 1]))
    group_local, group_rows, row_ids = kernels.check_expert_groups(
        slots, experts, sizes, np.array([1, 0], dtype=np.int32), 2, np.arange(4), np.arange(4)
    )
    assert group_local.tolist() == [0, 2] and group_rows.tolist() == [1, 1] and row_ids.tolist() == [1, 0]
    bad_rows = np.array([1, 5], dtype=np.int32)
    assert kernels.check_expert_groups(slots, experts, sizes, bad_rows, 2, np.arange(4), np.arange(4)) == ("bad_row", 1)


def test_no_code_outside_kernels_imports_a_c_loader():
    """services/, operator/ and benchmarks/ reach the C kernels through moemesh.kernels only."""
    offenders = []
    for folder in ("services", "operator", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module == "moemesh.kernels":
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moemesh.kernels."):
                    names = [node.module.split(".")[2]]
                elif isinstance(node, ast.Import):
                    names = [a.name.split(".")[2] for a in node.names if a.name.startswith("moemesh.kernels.")]
                offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names if name in LOADERS]
    assert offenders == []


def test_the_front_door_names_are_the_dispatch_functions():
    names = "quantized_gemv group_dequantize plan_expert_dispatch check_expert_groups int4_llama_decode_token"
    for name in names.split():
        assert getattr(kernels, name) is getattr(dispatch, name)
    assert kernels.INT4_FORMATS == {"int4pack": 0, "nibbles": 1, "blocks": 2}
