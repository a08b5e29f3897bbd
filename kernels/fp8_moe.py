"""Fused MoE expert FFN with block-scaled FP8 expert weights (DeepSeek-V3 format, see fp8.py).

Same contract as moe.py's fused_moe (y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),
ids < 0 skipped), with each expert's weights in FP8:
- w13 [E, 2 * I, H] e4m3fn: gate rows, then up rows; w13_scale_inv [E, 2 * ceil(I / bn), ceil(H / bk)]
  float32: the gate's scale blocks, then the up's (each half blocked on its own, i.e. the
  checkpoint's gate_proj and up_proj scales concatenated; = ceil(2I / bn) when bn divides I).
- w2 [E, H, I] e4m3fn; w2_scale_inv [E, ceil(H / bn), ceil(I / bk)] float32.

References: `fp8_fused_moe_w8a16_ref` (weights dequantized per tile, the CPU path) and
`fp8_fused_moe_w8a8_ref` (the Triton path's math: x quantized per token per bk group, the
fp32 SiLU-and-mul activation quantized the same way before the down projection).

Triton path, mirroring moe.py's launches (its align and combine kernels are reused as they are):
1. `_moe_align_kernel`: entries sorted by expert, segments padded to block_m.
2. `act_quant_triton`: x -> e4m3 + [T, ceil(H / bk)] scales, once per token (not per entry).
3. `_fp8_moe_gate_up_kernel`: grouped fp8 GEMM per (block of sorted entries, bk columns of I),
   gate and up from one pass, SiLU-and-mul, and the activation's per-group quantization fused in
   the epilogue (the tile's columns are exactly one group); writes e4m3 + scale per entry.
4. `_fp8_moe_down_kernel`: grouped fp8 GEMM with w2, scaled by the entry's routing weight.
5. `_moe_combine_kernel`: per token, the fp32 sum over its top_k entries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.kernels._triton import (
    HAS_TRITON,
    check_contiguous,
    check_dtype,
    check_inner_contiguous,
    check_launchable,
    check_out,
    check_shape,
    launch,
    next_pow2,
    scratch,
    tl,
    triton,
)
from moemesh.kernels.fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    act_quant_ref,
    act_quant_triton,
    cdiv,
    check_block,
    check_block_scaled,
)
from moemesh.kernels.fp8_gemm import check_block_k, fp8_gemm_ref, fp8_linear_w8a16_ref

if HAS_TRITON:
    from moemesh.kernels.moe import _moe_align_kernel, _moe_combine_kernel


def check_fp8_moe_weights(name, hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block):
    """The shapes the module docstring gives; returns (num_experts, hidden, inter, top_k)."""
    block_n, block_k = check_block(name, block)
    check_shape(name, "hidden_states", hidden_states, (None, None))
    num_tokens, hidden = hidden_states.shape
    check_shape(name, "w13", w13, (None, None, hidden))
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape[1] % 2:
        raise ValueError(f"{name}: w13 must stack gate and up rows, got {w13.shape[1]} rows")
    check_shape(name, "w13_scale_inv", w13_scale_inv, (num_experts, 2 * cdiv(inter, block_n), cdiv(hidden, block_k)))
    check_shape(name, "w2", w2, (num_experts, hidden, inter))
    check_block_scaled(name, w2, w2_scale_inv, block)
    check_dtype(name, "w13", w13, (FP8_DTYPE,))
    check_dtype(name, "w13_scale_inv", w13_scale_inv, (torch.float32,))
    check_shape(name, "topk_ids", topk_ids, (num_tokens, None))
    top_k = topk_ids.shape[1]
    check_shape(name, "topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype(name, "hidden_states", hidden_states, (torch.float16, torch.bfloat16, torch.float32))
    check_dtype(name, "topk_weights", topk_weights, (torch.float32,))
    check_dtype(name, "topk_ids", topk_ids, (torch.int32, torch.int64))
    return num_experts, hidden, inter, top_k


def _expert_groups(topk_ids: torch.Tensor):
    """(expert, entries [n], tokens [n]) per active expert; entries in order (stable sort)."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()  # [num_tokens * top_k]
    order = torch.argsort(flat_ids, stable=True)  # skipped entries (< 0) first, then by expert
    ends = torch.bincount(flat_ids.clamp(min=-1) + 1).cumsum(0).tolist()  # bin 0 = skipped
    for expert, (start, end) in enumerate(zip(ends[:-1], ends[1:])):
        if start < end:
            entries = order[start:end]
            yield expert, entries, entries // top_k


def fp8_fused_moe_w8a16_ref(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden] e4m3fn
    w13_scale_inv: torch.Tensor,  # [num_experts, 2 * ceil(intermediate / bn), ceil(hidden / bk)]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate] e4m3fn
    w2_scale_inv: torch.Tensor,  # [num_experts, ceil(hidden / bn), ceil(intermediate / bk)]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int, < 0 = skip
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Weight-only FP8 per active expert (fp8_linear_w8a16_ref: tile by tile), fp32 combine."""
    name = "fp8_fused_moe_w8a16_ref"
    _, hidden, inter, _ = check_fp8_moe_weights(
        name, hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block
    )
    half = cdiv(inter, block[0])  # scale blocks of the gate half
    flat_weights = topk_weights.reshape(-1).float()  # [num_tokens * top_k]
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e, entries, tokens in _expert_groups(topk_ids):
        x = hidden_states[tokens]  # [n, hidden]
        gate = fp8_linear_w8a16_ref(x, w13[e, :inter], w13_scale_inv[e, :half], block)  # [n, intermediate]
        up = fp8_linear_w8a16_ref(x, w13[e, inter:], w13_scale_inv[e, half:], block)
        act = (F.silu(gate.float()) * up.float()).to(hidden_states.dtype)
        y = fp8_linear_w8a16_ref(act, w2[e], w2_scale_inv[e], block)  # [n, hidden]
        out.index_add_(0, tokens, y.float() * flat_weights[entries, None])
    return out.to(hidden_states.dtype)


def fp8_fused_moe_w8a8_ref(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden] e4m3fn
    w13_scale_inv: torch.Tensor,  # [num_experts, 2 * ceil(intermediate / bn), ceil(hidden / bk)]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate] e4m3fn
    w2_scale_inv: torch.Tensor,  # [num_experts, ceil(hidden / bn), ceil(intermediate / bk)]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int, < 0 = skip
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:  # [num_tokens, hidden]
    """The Triton path's math: quantized x, fp32 gate/up, quantized fp32 activation, fp32 down."""
    name = "fp8_fused_moe_w8a8_ref"
    _, hidden, inter, _ = check_fp8_moe_weights(
        name, hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block
    )
    half = cdiv(inter, block[0])
    x_q, x_scale = act_quant_ref(hidden_states, block[1])  # [num_tokens, hidden], [num_tokens, hb]
    flat_weights = topk_weights.reshape(-1).float()
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for e, entries, tokens in _expert_groups(topk_ids):
        xq, xs = x_q[tokens], x_scale[tokens]
        gate = fp8_gemm_ref(xq, xs, w13[e, :inter], w13_scale_inv[e, :half], block)  # [n, intermediate] fp32
        up = fp8_gemm_ref(xq, xs, w13[e, inter:], w13_scale_inv[e, half:], block)
        act_q, act_scale = act_quant_ref(F.silu(gate) * up, block[1])
        y = fp8_gemm_ref(act_q, act_scale, w2[e], w2_scale_inv[e], block)  # [n, hidden] fp32
        out.index_add_(0, tokens, y * flat_weights[entries, None])
    return out.to(hidden_states.dtype)


if HAS_TRITON:

    @triton.jit
    def _fp8_moe_gate_up_kernel(
        x_q_ptr,  # [num_tokens, hidden] float8e4nv, contiguous
        x_scale_ptr,  # [num_tokens, H_BLOCKS] float32
        w13_ptr,  # [num_experts, 2 * intermediate, hidden] float8e4nv, contiguous
        w13_scale_ptr,  # [num_experts, 2 * I_BLOCKS, H_BLOCKS] float32
        act_q_ptr,  # [num_entries, intermediate] float8e4nv
        act_scale_ptr,  # [num_entries, I_GROUPS] float32
        sorted_entries_ptr,  # [max_num_padded] int32
        expert_ends_ptr,  # [num_experts] int32
        num_padded_ptr,  # [1] int32
        num_entries,
        NUM_EXPERTS: tl.constexpr,
        TOP_K: tl.constexpr,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        H_BLOCKS: tl.constexpr,  # ceil(hidden / BLOCK_K)
        I_BLOCKS: tl.constexpr,  # ceil(intermediate / SCALE_BLOCK_N)
        I_GROUPS: tl.constexpr,  # ceil(intermediate / BLOCK_N)
        SCALE_BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,  # = block_k: one activation group per tile
        BLOCK_K: tl.constexpr,  # = block_k
        BLOCK_E: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        experts = tl.arange(0, BLOCK_E)
        ends = tl.load(expert_ends_ptr + experts, mask=experts < NUM_EXPERTS, other=2147483647)
        expert = tl.sum(tl.where(ends <= pid_m * BLOCK_M, 1, 0), 0).to(tl.int64)
        entries = tl.load(sorted_entries_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
        row_valid = entries < num_entries
        tokens = entries // TOP_K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = cols < INTER
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_q_ptr + tokens[:, None] * HIDDEN + ks[None, :]
        w_ptrs = w13_ptr + expert * (2 * INTER * HIDDEN) + cols[None, :].to(tl.int64) * HIDDEN + ks[:, None]
        a_scale_ptrs = x_scale_ptr + tokens * H_BLOCKS
        gate_scale_ptrs = w13_scale_ptr + expert * (2 * I_BLOCKS * H_BLOCKS) + (cols // SCALE_BLOCK_N) * H_BLOCKS
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(H_BLOCKS):
            k_valid = ks < HIDDEN - kb * BLOCK_K
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w_mask = k_valid[:, None] & col_valid[None, :]
            w_gate = tl.load(w_ptrs + kb * BLOCK_K, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            w_up = tl.load(w_ptrs + INTER * HIDDEN + kb * BLOCK_K, mask=w_mask, other=0.0)
            a_scale = tl.load(a_scale_ptrs + kb, mask=row_valid, other=0.0)[:, None]
            gate_scale = tl.load(gate_scale_ptrs + kb, mask=col_valid, other=0.0)[None, :]
            up_scale = tl.load(gate_scale_ptrs + I_BLOCKS * H_BLOCKS + kb, mask=col_valid, other=0.0)[None, :]
            acc_gate += tl.dot(a, w_gate) * a_scale * gate_scale
            acc_up += tl.dot(a, w_up) * a_scale * up_scale
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BLOCK_M, BLOCK_N]; 0 in masked columns
        # per-entry quantization of this group of columns, as fp8.py's _act_quant_kernel does
        act_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(act), 1), 1e-10), 448.0)  # [BLOCK_M]
        y = tl.minimum(tl.maximum(tl.math.div_rn(act, act_scale[:, None]), -448.0), 448.0)
        mag = tl.abs(y)
        bits = mag.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        mag = tl.where(mag < 0.015625, (mag + 24576.0) - 24576.0, normal)
        act_q = tl.where(y < 0, -mag, mag)
        out_mask = row_valid[:, None] & col_valid[None, :]
        tl.store(
            act_q_ptr + entries[:, None] * INTER + cols[None, :], act_q.to(act_q_ptr.dtype.element_ty), mask=out_mask
        )
        tl.store(act_scale_ptr + entries * I_GROUPS + pid_n, act_scale, mask=row_valid)

    @triton.jit
    def _fp8_moe_down_kernel(
        act_q_ptr,  # [num_entries, intermediate] float8e4nv
        act_scale_ptr,  # [num_entries, I_GROUPS] float32
        w2_ptr,  # [num_experts, hidden, intermediate] float8e4nv, contiguous
        w2_scale_ptr,  # [num_experts, ceil(hidden / SCALE_BLOCK_N), I_GROUPS] float32
        topk_weights_ptr,  # [num_entries] float32
        entry_out_ptr,  # [num_entries, hidden]
        sorted_entries_ptr,  # [max_num_padded] int32
        expert_ends_ptr,  # [num_experts] int32
        num_padded_ptr,  # [1] int32
        num_entries,
        NUM_EXPERTS: tl.constexpr,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        I_GROUPS: tl.constexpr,  # ceil(intermediate / BLOCK_K)
        SCALE_BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # = block_k
        BLOCK_E: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        experts = tl.arange(0, BLOCK_E)
        ends = tl.load(expert_ends_ptr + experts, mask=experts < NUM_EXPERTS, other=2147483647)
        expert = tl.sum(tl.where(ends <= pid_m * BLOCK_M, 1, 0), 0).to(tl.int64)
        entries = tl.load(sorted_entries_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_valid = entries < num_entries
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = cols < HIDDEN
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = act_q_ptr + entries[:, None] * INTER + ks[None, :]
        w_ptrs = w2_ptr + expert * (HIDDEN * INTER) + cols[None, :].to(tl.int64) * INTER + ks[:, None]
        a_scale_ptrs = act_scale_ptr + entries * I_GROUPS
        num_n_blocks = (HIDDEN + SCALE_BLOCK_N - 1) // SCALE_BLOCK_N
        w_scale_ptrs = w2_scale_ptr + expert * (num_n_blocks * I_GROUPS) + (cols // SCALE_BLOCK_N) * I_GROUPS
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(I_GROUPS):
            k_valid = ks < INTER - kb * BLOCK_K
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(
                w_ptrs + kb * BLOCK_K, mask=k_valid[:, None] & col_valid[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_N]
            a_scale = tl.load(a_scale_ptrs + kb, mask=row_valid, other=0.0)
            w_scale = tl.load(w_scale_ptrs + kb, mask=col_valid, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        weight = tl.load(topk_weights_ptr + entries, mask=row_valid, other=0.0)
        out_ptrs = entry_out_ptr + entries[:, None] * HIDDEN + cols[None, :]
        out_mask = row_valid[:, None] & col_valid[None, :]
        tl.store(out_ptrs, (acc * weight[:, None]).to(entry_out_ptr.dtype.element_ty), mask=out_mask)


def fp8_fused_moe_triton(
    hidden_states: torch.Tensor,  # [num_tokens, hidden], dense rows
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden] e4m3fn, contiguous
    w13_scale_inv: torch.Tensor,  # [num_experts, 2 * ceil(intermediate / bn), ceil(hidden / bk)] float32
    w2: torch.Tensor,  # [num_experts, hidden, intermediate] e4m3fn, contiguous
    w2_scale_inv: torch.Tensor,  # [num_experts, ceil(hidden / bn), ceil(intermediate / bk)] float32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64, < 0 = skip
    block: tuple[int, int] = DEFAULT_BLOCK,
    block_m: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]
    name = "fp8_fused_moe_triton"
    check_launchable(name, hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids)
    num_experts, hidden, inter, top_k = check_fp8_moe_weights(
        name, hidden_states, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, block
    )
    block_n, block_k = block
    check_block_k(name, block_k)
    for what, t in (("w13", w13), ("w13_scale_inv", w13_scale_inv), ("w2", w2), ("w2_scale_inv", w2_scale_inv)):
        check_contiguous(name, what, t)
    check_contiguous(name, "topk_weights", topk_weights)
    check_contiguous(name, "topk_ids", topk_ids)
    check_inner_contiguous(name, "hidden_states", hidden_states, 1)
    num_tokens = hidden_states.shape[0]
    out = check_out(name, out, hidden_states, (num_tokens, hidden))
    num_entries = num_tokens * top_k
    if num_entries == 0:
        return out.zero_()
    if block_m is None:
        block_m = 16 if num_entries <= 4 * num_experts else 64
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"{name}: block_m must be a power of two >= 16, got {block_m}")
    device, dtype = hidden_states.device, hidden_states.dtype
    block_e = next_pow2(num_experts + 1)
    max_num_padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    # [max_num_padded] entry ids grouped by expert, segments padded to block_m with num_entries
    sorted_entries = torch.full((max_num_padded,), num_entries, dtype=torch.int32, device=device)
    expert_ends = scratch((num_experts,), torch.int32, device)  # [num_experts]
    num_padded = scratch((1,), torch.int32, device)  # [1]
    launch(
        _moe_align_kernel,
        (1,),
        topk_ids,
        sorted_entries,
        expert_ends,
        num_padded,
        num_entries,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_N=64 if block_e <= 256 else 32,
    )
    x_q, x_scale = act_quant_triton(hidden_states, block_k)  # [num_tokens, hidden], [num_tokens, hb]
    num_m_blocks = triton.cdiv(max_num_padded, block_m)
    i_groups = cdiv(inter, block_k)
    routing = dict(NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_E=block_e, SCALE_BLOCK_N=block_n, BLOCK_K=block_k)
    act_q = scratch((num_entries, inter), FP8_DTYPE, device)  # [num_entries, intermediate]
    act_scale = scratch((num_entries, i_groups), torch.float32, device)  # [num_entries, i_groups]
    launch(
        _fp8_moe_gate_up_kernel,
        (num_m_blocks, i_groups),
        x_q,
        x_scale,
        w13,
        w13_scale_inv,
        act_q,
        act_scale,
        sorted_entries,
        expert_ends,
        num_padded,
        num_entries,
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        H_BLOCKS=cdiv(hidden, block_k),
        I_BLOCKS=cdiv(inter, block_n),
        I_GROUPS=i_groups,
        BLOCK_N=block_k,
        num_warps=8,
        num_stages=3,
        **routing,
    )
    entry_out = scratch((num_entries, hidden), dtype, device)  # [num_entries, hidden]
    down_block_n = 64 if num_m_blocks * triton.cdiv(hidden, 128) < 264 else 128  # decode: more programs
    launch(
        _fp8_moe_down_kernel,
        (num_m_blocks, triton.cdiv(hidden, down_block_n)),
        act_q,
        act_scale,
        w2,
        w2_scale_inv,
        topk_weights,
        entry_out,
        sorted_entries,
        expert_ends,
        num_padded,
        num_entries,
        HIDDEN=hidden,
        INTER=inter,
        I_GROUPS=i_groups,
        BLOCK_N=down_block_n,
        num_warps=8 if down_block_n == 128 else 4,
        num_stages=3,
        **routing,
    )
    combine_block = min(1024, next_pow2(hidden))
    launch(
        _moe_combine_kernel,
        (num_tokens, triton.cdiv(hidden, combine_block)),
        entry_out,
        topk_ids,
        out,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HIDDEN=hidden,
        BLOCK=combine_block,
    )
    return out
