import os
import subprocess
import sys

import pytest
import torch

import moemesh.kernels as kernels
from moemesh.kernels import dispatch
from moemesh.kernels.gating import grouped_topk_ref, topk_softmax_ref
from moemesh.kernels.kv_store import store_kv_cache_ref
from moemesh.kernels.mla import mla_decode_attention_ref
from moemesh.kernels.moe import fused_moe_ref
from moemesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from moemesh.kernels.rotary import rotary_embedding_ref

TRITON_LAUNCHERS = [name for name in vars(dispatch) if name.endswith("_triton") and not name.startswith("_")]


def _cpu_calls():
    x = torch.randn(4, 8)
    logits = torch.randn(4, 8)
    w13, w2 = torch.randn(3, 6, 8), torch.randn(3, 8, 3)
    ids, weights = torch.tensor([[0, 2], [1, -1], [2, 0], [0, 1]]), torch.rand(4, 2)
    positions, cos_sin = torch.tensor([0, 5, 2, 7]), torch.randn(8, 8)
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    cache = torch.randn(3, 2, 1, 8)  # [num_blocks, block_size, num_kv_heads, head_dim]
    caches = [cache.clone() for _ in range(4)]
    slots = torch.tensor([4, -1, 0, 3])
    kernels.store_kv_cache(k, k, caches[0], caches[1], slots)
    store_kv_cache_ref(k, k, caches[2], caches[3], slots)
    mla_args = (
        torch.randn(2, 3, 6),
        torch.randn(2, 3, 2),
        torch.randn(3, 2, 8),
        torch.tensor([[0, 2], [1, 0]], dtype=torch.int32),
    )
    lens = torch.tensor([3, 2], dtype=torch.int32)
    return [
        (caches[0], caches[2]),
        (
            kernels.rotary_embedding(positions, q, k, cos_sin, False),
            rotary_embedding_ref(positions, q, k, cos_sin, False),
        ),
        (kernels.fused_add_rms_norm(x, x, torch.ones(8), 1e-6), fused_add_rms_norm_ref(x, x, torch.ones(8), 1e-6)),
        (kernels.mla_decode_attention(*mla_args, lens, 0.5), mla_decode_attention_ref(*mla_args, lens, 0.5)),
        (kernels.rms_norm(x, torch.ones(8), 1e-6), rms_norm_ref(x, torch.ones(8), 1e-6)),
        (kernels.topk_softmax(logits, 2, True), topk_softmax_ref(logits, 2, True)),
        (
            kernels.grouped_topk(logits, 2, 4, 2, torch.zeros(8), True, 2.0),
            grouped_topk_ref(logits, 2, 4, 2, torch.zeros(8), True, 2.0),
        ),
        (kernels.fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids)),
    ]


def test_cpu_tensors_take_the_reference_path_and_never_a_triton_launcher(monkeypatch):
    assert len(TRITON_LAUNCHERS) == 12
    for name in TRITON_LAUNCHERS:
        monkeypatch.setattr(dispatch, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran on CPU tensors"))
    for got, expected in _cpu_calls():
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_the_triton_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    called = []
    original = dispatch.rms_norm_triton
    monkeypatch.setattr(dispatch, "rms_norm_triton", lambda *a: called.append(1) or original(*a))
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(64, device="cuda", dtype=torch.bfloat16)  # in x's dtype, as the engine's norms hold it
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    assert called


def test_the_package_imports_and_serves_on_cpu_without_triton(tmp_path):
    program = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
import moemesh.kernels as kernels
from moemesh.kernels import _triton
from moemesh.kernels.norm import rms_norm_triton
assert not _triton.HAS_TRITON
x = torch.randn(3, 8)
assert kernels.rms_norm(x, torch.ones(8), 1e-6).shape == (3, 8)
try:
    rms_norm_triton(x, torch.ones(8), 1e-6)
except ValueError as e:
    assert "triton is not installed" in str(e)
else:
    raise AssertionError("the launcher ran without triton")
print("ok")
"""
    # cwd outside the repository: its `operator/` folder would shadow the standard library module
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=dict(os.environ), cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
