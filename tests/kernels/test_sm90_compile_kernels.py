"""Every launcher's kernels compile for sm_90 at serving sizes, on the CPU (see kernel_sm90_compile)."""

import importlib

import pytest
import torch
from kernel_sm90_compile import compile_launch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

MODULES = ["kv_store", "paged_attention", "norm", "rotary", "gating", "moe", "mla"]
M, BF16, I32, I64 = "meta", torch.bfloat16, torch.int32, torch.int64


def _empty(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device=M)


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton's CUDA backend is not installed")
    if not isinstance(triton.language.standard.sum, JITFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1")
    # An interpreted launch first: it must leave triton.language fit for compiling afterwards.
    from moemesh.kernels.gating import topk_softmax_triton

    topk_softmax_triton(torch.randn(2, 8), 2, True)
    monkeypatch.delenv("TRITON_INTERPRET")  # launchers pick their GPU settings (no interpreter work-arounds)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a warm cache
    results = []
    for name in MODULES:
        module = importlib.import_module(f"moemesh.kernels.{name}")
        monkeypatch.setattr(module, "launch", lambda *a, **k: results.append(compile_launch(*a, **k)))
        monkeypatch.setattr(module, "check_launchable", lambda *a: None)  # meta tensors stand in for CUDA ones
    return results


def test_every_kernel_compiles_for_sm90_within_shared_memory(compiled):
    from moemesh.kernels import gating, kv_store, mla, moe, norm, rotary
    from moemesh.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton

    num_reqs, heads, kv_heads, head_dim, block_size, blocks = 64, 32, 8, 128, 16, 256  # 64 requests x 4k context
    cache = _empty(num_reqs * blocks, block_size, kv_heads, head_dim)
    tables, lens = _empty(num_reqs, blocks, dtype=I32), _empty(num_reqs, dtype=I32)
    kv_store.store_kv_cache_triton(
        _empty(512, kv_heads, head_dim), _empty(512, kv_heads, head_dim), cache, cache, _empty(512, dtype=I64)
    )
    paged_decode_attention_triton(_empty(num_reqs, heads, head_dim), cache, cache, tables, lens, 0.08)
    cu = _empty(num_reqs + 1, dtype=I32)
    paged_prefill_attention_triton(_empty(8192, heads, head_dim), cache, cache, cu, lens, tables, 0.08, max_q_len=2048)
    norm.fused_add_rms_norm_triton(_empty(512, 7168), _empty(512, 7168), _empty(7168, dtype=torch.float32), 1e-6)
    rotary.rotary_embedding_triton(
        _empty(512, dtype=I64),
        _empty(512, heads, head_dim),
        _empty(512, kv_heads, head_dim),
        _empty(4096, head_dim, dtype=torch.float32),
    )
    gating.topk_softmax_triton(_empty(512, 128), 8, True)
    gating.grouped_topk_triton(
        _empty(512, 256, dtype=torch.float32), 8, 8, 4, _empty(256, dtype=torch.float32), True, 2.5
    )
    experts, hidden, inter = 128, 2048, 768  # Qwen3-30B-A3B
    moe.fused_moe_triton(
        _empty(4096, hidden),
        _empty(experts, 2 * inter, hidden),
        _empty(experts, hidden, inter),
        _empty(4096, 8, dtype=torch.float32),
        _empty(4096, 8, dtype=I64),
    )
    mla.mla_decode_attention_triton(
        _empty(num_reqs, 128, 512),
        _empty(num_reqs, 128, 64),
        _empty(num_reqs * 64, 64, 576),
        tables[:, :64],
        lens,
        0.07,
    )
    # fp32 operands take the exact ("ieee") tl.dot path
    paged_decode_attention_triton(
        _empty(8, heads, head_dim, dtype=torch.float32), cache.float(), cache.float(), tables[:8], lens[:8], 0.08
    )
    moe.fused_moe_triton(
        _empty(64, 256, dtype=torch.float32),
        _empty(8, 512, 256, dtype=torch.float32),
        _empty(8, 256, 256, dtype=torch.float32),
        _empty(64, 2, dtype=torch.float32),
        _empty(64, 2, dtype=I64),
    )
    names = [r["name"] for r in compiled]
    assert names == [
        "_store_kv_cache_kernel",
        "_paged_decode_partition_kernel",
        "_paged_decode_reduce_kernel",
        "_paged_prefill_kernel",
        "_rms_norm_kernel",
        "_rotary_embedding_kernel",
        "_rotary_embedding_kernel",
        "_topk_softmax_kernel",
        "_grouped_topk_kernel",
        "_moe_align_kernel",
        "_moe_gate_up_kernel",
        "_moe_down_kernel",
        "_moe_combine_kernel",
        "_mla_decode_partition_kernel",
        "_paged_decode_reduce_kernel",
        "_paged_decode_partition_kernel",
        "_paged_decode_reduce_kernel",
        "_moe_align_kernel",
        "_moe_gate_up_kernel",
        "_moe_down_kernel",
        "_moe_combine_kernel",
    ]
