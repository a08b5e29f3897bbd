import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close_f64, nan_like

from moemesh.kernels.moe import fused_moe_ref, fused_moe_triton

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 40, 24, 6, 3  # neither dim a power of two: tiles are masked


def _naive_moe(x, w13, w2, topk_weights, topk_ids):
    """One (token, slot) at a time in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gate_up = w13[e].double() @ x[t].double()
            act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ act)
    return out


def _inputs(dtype, num_tokens=11):
    x = torch.randn(num_tokens, HIDDEN, dtype=dtype)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER) / INTER**0.5).to(dtype)
    topk_ids = (
        torch.rand(num_tokens, NUM_EXPERTS - 1).argsort(dim=1)[:, :TOP_K].contiguous()
    )  # distinct per token; expert 5 unused
    topk_weights = torch.rand(num_tokens, TOP_K) + 0.1
    if num_tokens > 3:
        topk_ids[1, 2] = -1  # a skipped slot (e.g. a dropped replica)
        topk_ids[3] = -1  # a token with every slot skipped: output zeros
        topk_weights[1, 2] = float("nan")  # a skipped slot's weight is ignored
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_moe_matches_the_float64_oracle(dtype):
    x, w13, w2, topk_weights, topk_ids = _inputs(dtype)
    out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, block_m=16, out=nan_like(x))
    expected = _naive_moe(x, w13, w2, topk_weights, topk_ids)
    assert_close_f64(out, expected, dtype)
    assert out[3].eq(0).all()


def test_triton_fused_moe_with_int32_ids_and_many_tokens_per_expert():
    """40 tokens x 3 slots over 5 experts: segments of ~24 entries span two 16-row blocks."""
    x, w13, w2, topk_weights, topk_ids = _inputs(torch.float32, num_tokens=40)
    out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids.int(), block_m=16, out=nan_like(x))
    assert_close_f64(out, _naive_moe(x, w13, w2, topk_weights, topk_ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_fused_moe_matches_the_float64_oracle(dtype):
    x, w13, w2, topk_weights, topk_ids = _inputs(dtype)
    assert_close_f64(
        fused_moe_ref(x, w13, w2, topk_weights, topk_ids), _naive_moe(x, w13, w2, topk_weights, topk_ids), dtype
    )


def test_fused_moe_of_no_tokens_is_empty():
    x, w13, w2, topk_weights, topk_ids = _inputs(torch.float32, num_tokens=0)
    assert fused_moe_triton(x, w13, w2, topk_weights, topk_ids).shape == (0, HIDDEN)
    assert fused_moe_ref(x, w13, w2, topk_weights, topk_ids).shape == (0, HIDDEN)


def test_triton_fused_moe_rejects_mismatched_weights():
    x, w13, w2, topk_weights, topk_ids = _inputs(torch.float32)
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_moe_triton(x, w13, w2[:, :, :-1], topk_weights, topk_ids)
    with pytest.raises(ValueError, match="w13 dtype"):
        fused_moe_triton(x, w13.bfloat16(), w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="topk_weights must be one of"):
        fused_moe_triton(x, w13, w2, topk_weights.double(), topk_ids)


def _worker_groups(topk_ids, experts_here):
    """An expert worker's request: the entries of `experts_here` grouped by expert (ascending),
    tokens ascending within a group, as (row_ids, experts, sizes, entry positions)."""
    rows, experts, sizes, positions = [], [], [], []
    for e in experts_here:
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel():
            rows.append(tokens), experts.append(e), sizes.append(tokens.numel())
            positions.append(tokens * topk_ids.shape[1] + slots)
    return torch.cat(rows), experts, sizes, torch.cat(positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("triton_path", [False, True])
def test_grouped_moe_matches_the_float64_oracle_over_the_worker_experts(dtype, triton_path, monkeypatch):
    """The expert worker's combine: per token the weighted sum over only this worker's experts."""
    from moemesh.kernels import dispatch

    if triton_path:
        if not dispatch.HAS_TRITON:
            pytest.skip("triton is not installed")
        monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)  # CPU tensors under TRITON_INTERPRET
    x, w13, w2, topk_weights, topk_ids = _inputs(dtype)
    here = [0, 2, 4]
    row_ids, experts, sizes, positions = _worker_groups(topk_ids, here)
    weights = topk_weights.reshape(-1)[positions]
    out = dispatch.grouped_moe(x, w13, w2, row_ids, experts, sizes, weights)
    mine = torch.where(torch.isin(topk_ids, torch.tensor(here)), topk_ids, -1)
    assert out.dtype == torch.float32
    assert_close_f64(out, _naive_moe(x, w13, w2, topk_weights, mine), dtype)


def test_grouped_moe_reference_is_the_fused_loop_bit_for_bit():
    """fused_moe_ref is the sort plus grouped_moe_ref: over all experts the two give the same bits."""
    from moemesh.kernels.moe import grouped_moe_ref

    x, w13, w2, topk_weights, topk_ids = _inputs(torch.bfloat16)
    row_ids, experts, sizes, positions = _worker_groups(topk_ids, range(NUM_EXPERTS))
    out = grouped_moe_ref(x, w13, w2, row_ids, experts, sizes, topk_weights.reshape(-1)[positions])
    assert torch.equal(out.to(x.dtype), fused_moe_ref(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_moe_kernels_compile_and_match_the_float64_oracle(dtype, monkeypatch):
    """On a GPU (not the interpreter): the engine's fused MoE and the expert worker's grouped MoE."""
    from moemesh import kernels

    monkeypatch.delenv("TRITON_INTERPRET")
    x, w13, w2, topk_weights, topk_ids = _inputs(dtype, num_tokens=40)
    on_gpu = [t.cuda() for t in (x, w13, w2, topk_weights, topk_ids)]
    assert_close_f64(kernels.fused_moe(*on_gpu).cpu(), _naive_moe(x, w13, w2, topk_weights, topk_ids), dtype)
    here = [0, 2, 4]
    row_ids, experts, sizes, positions = _worker_groups(topk_ids, here)
    weights = topk_weights.reshape(-1)[positions]
    out = kernels.grouped_moe(on_gpu[0], on_gpu[1], on_gpu[2], row_ids.cuda(), experts, sizes, weights.cuda())
    mine = torch.where(torch.isin(topk_ids, torch.tensor(here)), topk_ids, -1)
    assert out.dtype == torch.float32
    assert_close_f64(out.cpu(), _naive_moe(x, w13, w2, topk_weights, mine), dtype)
