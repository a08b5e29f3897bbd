"""Pick the Triton kernel on CUDA tensors, the C kernel (kernels/csrc/, through its loader module:
cpu_ops, cpu_moe, group_gemv, llama_decode, moe_dispatch) for the CPU operations it has, where it
is built and reads the tensors' layout, and the torch reference elsewhere.

Code outside kernels/ calls only these functions (re-exported by moemesh.kernels), never a loader.
Triton is imported by the kernel modules only if it is installed (see _triton.py), so this module
imports on machines without a GPU or without triton; CUDA tensors without triton fall back to the
references.
"""

import ctypes

import numpy as np
import torch

from moemesh.kernels import cpu_moe, cpu_ops, group_gemv, llama_decode, moe_dispatch
from moemesh.kernels._triton import HAS_TRITON
from moemesh.kernels.fp8 import DEFAULT_BLOCK
from moemesh.kernels.fp8_gemm import fp8_linear_triton, fp8_linear_w8a16_ref
from moemesh.kernels.fp8_moe import fp8_fused_moe_triton, fp8_fused_moe_w8a16_ref
from moemesh.kernels.gating import grouped_topk_ref, grouped_topk_triton, topk_softmax_ref, topk_softmax_triton
from moemesh.kernels.group_quant import group_dequantize_ref, group_gemv_ref
from moemesh.kernels.kv_store import store_kv_cache_ref, store_kv_cache_triton
from moemesh.kernels.mla import mla_decode_attention_ref, mla_decode_attention_triton
from moemesh.kernels.moe import fused_moe_triton, group_entries, grouped_moe_ref
from moemesh.kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from moemesh.kernels.paged_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)
from moemesh.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    if _use_triton(key):
        fn = store_kv_cache_triton
    elif cpu_ops.store_kv_usable(key, value, k_cache, slot_mapping):
        fn = cpu_ops.store_kv
    else:
        fn = store_kv_cache_ref
    fn(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, plan=None):
    """`plan`: the round's DecodePlan (paged_attention.py), which the torch reference reuses, or a
    function that builds it (called only when the reference runs)."""
    if _use_triton(query):
        return paged_decode_attention_triton(query, k_cache, v_cache, block_tables, context_lens, scale)
    if cpu_ops.decode_attention_usable(query, k_cache, block_tables, context_lens):
        return cpu_ops.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
    plan = plan() if callable(plan) else plan
    return paged_decode_attention_ref(query, k_cache, v_cache, block_tables, context_lens, scale, plan)


def paged_prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    if _use_triton(query):
        fn = paged_prefill_attention_triton
    elif cpu_ops.prefill_attention_usable(query, k_cache, cu_seqlens_q, context_lens, block_tables):
        fn = cpu_ops.paged_prefill_attention
    else:
        fn = paged_prefill_attention_ref
    return fn(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]; decode tokens first
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    num_decode_reqs: int,
    scale: float,
    decode_plan=None,  # an all-decode round's DecodePlan or its builder, shared by its layers (torch reference only)
) -> torch.Tensor:
    """One round's attention: the first `num_decode_reqs` requests have one query token each."""
    d = num_decode_reqs
    if d == context_lens.shape[0]:
        return paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, decode_plan)
    if d == 0:
        return paged_prefill_attention(query, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
    decode_out = paged_decode_attention(query[:d], k_cache, v_cache, block_tables[:d], context_lens[:d], scale)
    prefill_out = paged_prefill_attention(
        query[d:], k_cache, v_cache, cu_seqlens_q[d:] - cu_seqlens_q[d], context_lens[d:], block_tables[d:], scale
    )
    return torch.cat((decode_out, prefill_out), dim=0)


def mla_decode_attention(q_latent, q_rope, kv_cache, block_tables, context_lens, scale):
    fn = mla_decode_attention_triton if _use_triton(q_latent) else mla_decode_attention_ref
    return fn(q_latent, q_rope, kv_cache, block_tables, context_lens, scale)


def rms_norm(x, weight, eps):
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps)
    if cpu_ops.rms_norm_usable(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    if _use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if cpu_ops.rms_norm_usable(x, weight, residual):
        return cpu_ops.rms_norm(x, weight, eps, residual)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox_style=True, cos_sin=None):
    """`cos_sin`: cos_sin_cache[positions] when the caller already has it (the torch reference
    then skips the gather; the layers of one round share it)."""
    if _use_triton(query):
        return rotary_embedding_triton(positions, query, key, cos_sin_cache, is_neox_style)
    if is_neox_style and cpu_ops.rope_usable(query, key, cos_sin_cache, positions):
        return cpu_ops.rope_neox(positions, query, key, cos_sin_cache)
    return rotary_embedding_ref(positions, query, key, cos_sin_cache, is_neox_style, cos_sin)


def topk_softmax(router_logits, top_k, renormalize):
    fn = topk_softmax_triton if _use_triton(router_logits) else topk_softmax_ref
    return fn(router_logits, top_k, renormalize)


def grouped_topk(
    router_logits,
    top_k,
    num_expert_group,
    topk_group,
    e_score_correction_bias,
    renormalize,
    routed_scaling_factor,
    scoring_func="sigmoid",
):
    fn = grouped_topk_triton if _use_triton(router_logits) else grouped_topk_ref
    return fn(
        router_logits,
        top_k,
        num_expert_group,
        topk_group,
        e_score_correction_bias,
        renormalize,
        routed_scaling_factor,
        scoring_func,
    )


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids):
    if _use_triton(hidden_states):
        # the routing tensors are tiny: made dense here rather than rejected by the launcher
        return fused_moe_triton(hidden_states, w13, w2, topk_weights.contiguous(), topk_ids.contiguous())
    out = grouped_moe(hidden_states, w13, w2, *group_entries(topk_weights, topk_ids))  # fused_moe_ref's groups
    return out.to(hidden_states.dtype)


def grouped_moe(hidden_states, w13, w2, row_ids, experts, sizes, weights):
    """Entries already grouped by expert (an expert worker's request): per row of hidden_states,
    the float32 sum of weight * E(x) over its entries, in entry order. Reference: one matmul pair
    per group on the gathered rows; on CPU tensors it reads, the C kernel (cpu_moe.c) for every
    group, so an entry's bits do not depend on the rest of its round;
    Triton: the rows gathered once, fused_moe with one slot each, then the weighted rows added
    (the same sums)."""
    if not _use_triton(hidden_states):
        if cpu_moe.usable(hidden_states, w13, w2):
            return cpu_moe.grouped_moe(hidden_states, w13, w2, row_ids, experts, sizes, weights)
        return grouped_moe_ref(hidden_states, w13, w2, row_ids, experts, sizes, weights)
    ids = torch.repeat_interleave(
        torch.tensor(experts, device=row_ids.device), torch.tensor(sizes, device=row_ids.device)
    )
    rows = hidden_states.index_select(0, row_ids)  # [num_entries, hidden]
    ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    y = fused_moe(rows, w13, w2, ones, ids[:, None])  # [num_entries, hidden]
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    return out.index_add_(0, row_ids, y.float() * weights[:, None])


def fp8_linear(
    x: torch.Tensor,  # [..., K] float16 / bfloat16 / float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32 (DeepSeek-V3 weight_scale_inv)
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:  # [..., N] in x.dtype
    """y = x @ W^T: W8A8 Triton on CUDA, weight-only tile-by-tile torch reference elsewhere."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if _use_triton(x):
        y = fp8_linear_triton(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, scale_inv, block)
    else:
        y = fp8_linear_w8a16_ref(x2, weight, scale_inv, block)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_fused_moe(hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block=DEFAULT_BLOCK):
    """fused_moe with block-scaled FP8 expert weights (layouts in fp8_moe.py)."""
    args = (hidden_states, w13, w13_scale_inv, w2, w2_scale_inv)
    if not _use_triton(hidden_states):
        return fp8_fused_moe_w8a16_ref(*args, topk_weights, topk_ids, block)
    return fp8_fused_moe_triton(*args, topk_weights.contiguous(), topk_ids.contiguous(), block)


# -- group-quantized weights (GGUF codes with their scales: group_quant.py's layouts) ---------------


def quantized_kernels_built() -> bool:
    """The C library for group-quantized weights (csrc/group_gemv.c) is built on this machine
    (built now, on the first call: the warm-up). Without it the quantized layers dequantize per
    call with torch, and int4pack / code-block layouts are never chosen."""
    return group_gemv.library() is not None


def quantized_gemv(
    x: torch.Tensor,  # [M, K], any floating dtype
    codes: torch.Tensor,  # [N, K] int8, or [N, K / 2] uint8 nibbles
    scale: torch.Tensor,  # [N, K // group] float32 or float16
    mins: torch.Tensor | None = None,  # like scale, or None
) -> torch.Tensor:  # [M, N] float32
    """y = x @ W^T, W[n, g * group + j] = scale[n, g] * q (+ mins[n, g]), in float32: the C GEMV
    (the weight read once for all rows) on CPU tensors, the torch reference elsewhere."""
    if not x.is_cuda and quantized_kernels_built():
        return group_gemv.group_gemv(x, codes, scale, mins)
    return group_gemv_ref(x, codes, scale, mins)


def group_dequantize(
    codes: torch.Tensor,  # [N, K] int8, or [N, K / 2] uint8 nibbles
    scale: torch.Tensor,  # [N, K // group] float32 or float16
    mins: torch.Tensor | None,  # like scale, or None
    dtype: torch.dtype,
    rows: slice | torch.Tensor = slice(None),  # a range of rows, or row indices (a gather)
    out: torch.Tensor | None = None,  # [R, K] of `dtype`, contiguous
) -> torch.Tensor:  # [R, K]
    """Rows of W in `dtype`, code * scale (+ min) rounded once: the C kernel for float32 and
    bfloat16 CPU outputs, the torch reference (the same values for GGUF's scales) elsewhere."""
    if dtype in (torch.float32, torch.bfloat16) and not codes.is_cuda and quantized_kernels_built():
        return group_gemv.dequantize(codes, scale, mins, dtype, rows, out)
    return group_dequantize_ref(codes, scale, mins, dtype, rows, out)


# -- one decode token through a 4-bit Llama stack (csrc/llama_decode.c) ----------------------------


def llama_decode_built() -> bool:
    """The one-token Llama decoder's C library is built here (built now, on the first call).
    Without it the model runs its eager stack, the reference."""
    return llama_decode.library() is not None


def int4_llama_decode_token(
    dims: llama_decode.Int4Dims,
    layers: ctypes.Array,  # of Int4Layer
    hidden: torch.Tensor,  # [hidden] in the activation dtype, contiguous: the embedding in, the last MLP output out
    residual: torch.Tensor,  # [hidden] likewise: written
    position: int,
    slot: int,
    block_table: torch.Tensor,  # [max_blocks] int32, contiguous
    context_len: int,
) -> None:
    """One token through every layer in one C call (llama_decode.py); callers check
    llama_decode_built() first, as there is no torch path at this level."""
    llama_decode.int4_llama_decode_token(dims, layers, hidden, residual, position, slot, block_table, context_len)


# -- a MoE layer's expert dispatch (csrc/moe_dispatch.c) and routed experts (csrc/cpu_moe.c) --------


def plan_expert_dispatch(
    tables: moe_dispatch.LayerTables,
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64, contiguous, CPU
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32, contiguous, CPU
) -> moe_dispatch.DispatchPlan | None:
    """The attention side's per-worker batches in one C call, or None without the C library (the
    caller's numpy path computes the same plan)."""
    lib = moe_dispatch.library()
    return None if lib is None else moe_dispatch.plan_dispatch(lib, tables, topk_ids, topk_weights)


def check_expert_groups(
    slots: np.ndarray,  # [num_groups] the replica slot of each group
    experts: np.ndarray,  # [num_groups] its logical expert
    sizes: np.ndarray,  # [num_groups] its entries
    row_ids: np.ndarray,  # [num_entries] rows of the request's hidden states
    num_rows: int,
    local_index: np.ndarray,  # [num_slots] the worker's replica of each slot, -1: not held here
    phy2log: np.ndarray,  # [num_slots] the layer's logical expert of each slot
):
    """The expert side's request check in one C pass: (group_local, group_rows, row ids) int64,
    or (error name, index) for what is wrong; None without the C library (the caller's numpy
    checks run instead)."""
    lib = moe_dispatch.library()
    if lib is None:
        return None
    return moe_dispatch.check_groups(lib, slots, experts, sizes, row_ids, num_rows, local_index, phy2log)


def build_expert_dispatch_kernel() -> bool:
    """Build (or find in the cache) the expert dispatch's C library now, at start-up rather than
    in the first MoE layer; False where it cannot be built (numpy then plans)."""
    return moe_dispatch.library() is not None


def build_grouped_moe_kernel() -> bool:
    """Build (or find in the cache) the CPU routed-expert kernel now, at start-up rather than in the
    first MoE layer; False where it cannot be built (torch's matmuls then run the experts)."""
    return cpu_moe.library() is not None
