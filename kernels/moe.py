"""Fused MoE expert FFN: y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),
e = topk_ids[t, j].

Weights: w13 [num_experts, 2 * intermediate, hidden] holds the gate rows first, then the up rows;
w2 [num_experts, hidden, intermediate]. "Experts" here are whatever the caller indexes: with a
placement they are physical replicas (the caller maps logical experts to replicas). An id < 0
means "skip this slot" (its weight is ignored); ids >= num_experts are a caller error (the
reference raises; the kernels skip them rather than read out of bounds).

Triton path, four launches:
1. `_moe_align_kernel` (one program): counting sort of the num_tokens * top_k (token, slot)
   entries by expert into a list whose per-expert segments are padded to `block_m`
   (moe_align_block_size); ties keep entry order, so the result is deterministic.
2. `_moe_gate_up_kernel`: grouped GEMM, one program per (block of block_m sorted entries, tile
   of the intermediate dim), both the gate and the up tile from one pass over x, SiLU-and-mul
   fused; writes the activation per entry.
3. `_moe_down_kernel`: grouped GEMM of the activation with w2, scaled by the entry's weight.
4. `_moe_combine_kernel`: per token, the sum over its top_k entries in fp32.
A block's expert is found from the segment ends (no per-block table), and the grids use an upper
bound on the padded length, so nothing syncs with the host.
"""

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
    dot_precision,
    launch,
    next_pow2,
    scratch,
    tl,
    triton,
    upcast_dot,
)


def group_entries(
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64, < 0 = skip
) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """The (token, slot) entries grouped by expert (a stable sort; skipped entries dropped), as
    `grouped_moe_ref` takes them: (row ids, the expert of each group, group sizes, weights)."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()  # [num_tokens * top_k]
    order = torch.argsort(flat_ids, stable=True)  # skipped entries (< 0) first, then by expert
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=1).tolist()  # [1 + max id + 1]; bin 0 = skipped
    experts = [e for e, n in enumerate(counts[1:]) if n]
    sizes = [counts[e + 1] for e in experts]
    active = order[counts[0] :]  # [num_active_entries], grouped by expert
    return active // top_k, experts, sizes, topk_weights.reshape(-1).float()[active]


def fused_moe_ref(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int64, < 0 = skip
) -> torch.Tensor:  # [num_tokens, hidden]
    """Tokens grouped by expert (stable sort of the entries), one matmul pair per active expert,
    weighted rows index_add-ed into an fp32 output."""
    out = grouped_moe_ref(hidden_states, w13, w2, *group_entries(topk_weights, topk_ids))
    return out.to(hidden_states.dtype)


def grouped_moe_ref(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    row_ids: torch.Tensor,  # [num_entries] int64 rows of hidden_states, grouped by expert
    experts: list[int],  # the expert of each group
    sizes: list[int],  # the entries of each group
    weights: torch.Tensor,  # [num_entries] float32
) -> torch.Tensor:  # [num_tokens, hidden] float32: per row, sum of w * E(x) over its entries, in entry order
    """The loop of `fused_moe_ref` over entries already grouped (an expert worker's request is):
    one matmul pair per group on the gathered rows, the weighted outputs added in float32."""
    inter = w13.shape[1] // 2
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    start = 0
    for expert, size in zip(experts, sizes):
        if not size:
            continue
        rows = row_ids[start : start + size]  # [n]
        gate_up = hidden_states[rows] @ w13[expert].t()  # [n, 2 * intermediate]
        act = (F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(hidden_states.dtype)
        y = act @ w2[expert].t()  # [n, hidden]
        out.index_add_(0, rows, y.float() * weights[start : start + size, None])
        start += size
    return out


if HAS_TRITON:

    @triton.jit
    def _moe_align_kernel(
        topk_ids_ptr,  # [num_entries] (the flattened [num_tokens, top_k])
        sorted_entries_ptr,  # [max_num_padded] int32, pre-filled with num_entries (= padding)
        expert_ends_ptr,  # [num_experts] int32, end of each expert's padded segment
        num_padded_ptr,  # [1] int32, total padded length
        num_entries,
        NUM_EXPERTS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_E: tl.constexpr,  # > NUM_EXPERTS: bin NUM_EXPERTS collects skipped entries
        BLOCK_N: tl.constexpr,
    ):
        experts = tl.arange(0, BLOCK_E)
        lanes = tl.arange(0, BLOCK_N)
        counts = tl.zeros([BLOCK_E], tl.int32)
        for n0 in range(0, num_entries, BLOCK_N):
            idx = n0 + lanes
            e = tl.load(topk_ids_ptr + idx, mask=idx < num_entries, other=-1)
            e = tl.where((e >= 0) & (e < NUM_EXPERTS), e, NUM_EXPERTS).to(tl.int32)
            counts += tl.histogram(e, BLOCK_E)
        counts = tl.where(experts < NUM_EXPERTS, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(expert_ends_ptr + experts, ends, mask=experts < NUM_EXPERTS)
        tl.store(num_padded_ptr, tl.sum(padded, 0))
        cursor = ends - padded  # next free position of each expert's segment
        earlier = lanes[None, :] < lanes[:, None]  # [BLOCK_N, BLOCK_N]: lane j before lane i
        for n0 in range(0, num_entries, BLOCK_N):
            idx = n0 + lanes
            e = tl.load(topk_ids_ptr + idx, mask=idx < num_entries, other=-1)
            e = tl.where((e >= 0) & (e < NUM_EXPERTS), e, NUM_EXPERTS).to(tl.int32)
            rank = tl.sum(tl.where((e[:, None] == e[None, :]) & earlier, 1, 0), 1)  # among this chunk's same expert
            base = tl.sum(tl.where(e[:, None] == experts[None, :], cursor[None, :], 0), 1)
            tl.store(sorted_entries_ptr + base + rank, idx, mask=e < NUM_EXPERTS)
            cursor += tl.histogram(e, BLOCK_E)

    @triton.jit
    def _moe_gate_up_kernel(
        hidden_ptr,  # [num_tokens, hidden], dense rows
        w13_ptr,  # [num_experts, 2 * intermediate, hidden], contiguous
        act_ptr,  # [num_entries, intermediate]: silu(gate) * up per entry
        sorted_entries_ptr,  # [max_num_padded] int32
        expert_ends_ptr,  # [num_experts] int32
        num_padded_ptr,  # [1] int32
        num_entries,
        hidden_row_stride,
        NUM_EXPERTS: tl.constexpr,
        TOP_K: tl.constexpr,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        experts = tl.arange(0, BLOCK_E)
        ends = tl.load(expert_ends_ptr + experts, mask=experts < NUM_EXPERTS, other=2147483647)
        expert = tl.sum(tl.where(ends <= pid_m * BLOCK_M, 1, 0), 0).to(tl.int64)
        entries = tl.load(sorted_entries_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
        row_valid = entries < num_entries
        tokens = (entries // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_valid = cols < INTER
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = hidden_ptr + tokens[:, None] * hidden_row_stride + ks[None, :]
        w_ptrs = w13_ptr + expert * (2 * INTER * HIDDEN) + cols[None, :].to(tl.int64) * HIDDEN + ks[:, None]
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k_valid = ks < HIDDEN - k0
            a = tl.load(a_ptrs + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w_mask = k_valid[:, None] & col_valid[None, :]
            w_gate = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            w_up = tl.load(w_ptrs + INTER * HIDDEN + k0, mask=w_mask, other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w_gate = w_gate.to(tl.float32)
                w_up = w_up.to(tl.float32)
            acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
        out_ptrs = act_ptr + entries[:, None].to(tl.int64) * INTER + cols[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])

    @triton.jit
    def _moe_down_kernel(
        act_ptr,  # [num_entries, intermediate]
        w2_ptr,  # [num_experts, hidden, intermediate], contiguous
        topk_weights_ptr,  # [num_entries] float32
        entry_out_ptr,  # [num_entries, hidden]: weighted expert output per entry
        sorted_entries_ptr,  # [max_num_padded] int32
        expert_ends_ptr,  # [num_experts] int32
        num_padded_ptr,  # [1] int32
        num_entries,
        NUM_EXPERTS: tl.constexpr,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
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
        a_ptrs = act_ptr + entries[:, None] * INTER + ks[None, :]
        w_ptrs = w2_ptr + expert * (HIDDEN * INTER) + cols[None, :].to(tl.int64) * INTER + ks[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k_valid = ks < INTER - k0
            a = tl.load(a_ptrs + k0, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        weight = tl.load(topk_weights_ptr + entries, mask=row_valid, other=0.0)
        out_ptrs = entry_out_ptr + entries[:, None] * HIDDEN + cols[None, :]
        tl.store(
            out_ptrs,
            (acc * weight[:, None]).to(entry_out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & col_valid[None, :],
        )

    @triton.jit
    def _moe_combine_kernel(
        entry_out_ptr,  # [num_tokens * top_k, hidden]
        topk_ids_ptr,  # [num_tokens * top_k]
        out_ptr,  # [num_tokens, hidden]
        NUM_EXPERTS: tl.constexpr,
        TOP_K: tl.constexpr,
        HIDDEN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            e = tl.load(topk_ids_ptr + token * TOP_K + j)
            limit = tl.where(e >= 0, tl.where(e < NUM_EXPERTS, HIDDEN, 0), 0)  # skipped slot: read nothing
            y = tl.load(entry_out_ptr + (token * TOP_K + j) * HIDDEN + cols, mask=cols < limit, other=0.0)
            acc += y.to(tl.float32)
        tl.store(out_ptr + token * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < HIDDEN)


def fused_moe_triton(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64, < 0 = skip
    block_m: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor:  # [num_tokens, hidden]
    name = "fused_moe_triton"
    check_launchable(name, hidden_states, w13, w2, topk_weights, topk_ids)
    check_shape(name, "hidden_states", hidden_states, (None, None))
    check_shape(name, "w13", w13, (None, None, hidden_states.shape[1]))
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape[1] % 2:
        raise ValueError(f"{name}: w13 must stack gate and up rows, got {w13.shape[1]} rows")
    check_shape(name, "w2", w2, (num_experts, hidden, inter))
    check_shape(name, "topk_ids", topk_ids, (num_tokens, None))
    top_k = topk_ids.shape[1]
    check_shape(name, "topk_weights", topk_weights, (num_tokens, top_k))
    check_dtype(name, "hidden_states", hidden_states, (torch.float16, torch.bfloat16, torch.float32))
    for what, t in (("w13", w13), ("w2", w2)):
        if t.dtype != hidden_states.dtype:
            raise ValueError(f"{name}: {what} dtype {t.dtype} differs from hidden_states dtype {hidden_states.dtype}")
        check_contiguous(name, what, t)
    check_dtype(name, "topk_weights", topk_weights, (torch.float32,))
    check_dtype(name, "topk_ids", topk_ids, (torch.int32, torch.int64))
    check_contiguous(name, "topk_weights", topk_weights)
    check_contiguous(name, "topk_ids", topk_ids)
    check_inner_contiguous(name, "hidden_states", hidden_states, 1)
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
    num_padded = scratch((1,), torch.int32, device)  # [1] padded length actually used
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
    num_m_blocks = triton.cdiv(max_num_padded, block_m)
    gemm = dict(
        NUM_EXPERTS=num_experts,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        UPCAST_DOT=upcast_dot(dtype),
        DOT_PRECISION=dot_precision(dtype),
    )
    act = scratch((num_entries, inter), dtype, device)  # [num_entries, intermediate]
    block_n, block_k = min(128, max(16, next_pow2(inter))), min(64, max(16, next_pow2(hidden)))
    launch(
        _moe_gate_up_kernel,
        (num_m_blocks, triton.cdiv(inter, block_n)),
        hidden_states,
        w13,
        act,
        sorted_entries,
        expert_ends,
        num_padded,
        num_entries,
        hidden_states.stride(0),
        TOP_K=top_k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8,
        num_stages=3,
        **gemm,
    )
    entry_out = scratch((num_entries, hidden), dtype, device)  # [num_entries, hidden]
    block_n, block_k = min(128, max(16, next_pow2(hidden))), min(64, max(16, next_pow2(inter)))
    launch(
        _moe_down_kernel,
        (num_m_blocks, triton.cdiv(hidden, block_n)),
        act,
        w2,
        topk_weights,
        entry_out,
        sorted_entries,
        expert_ends,
        num_padded,
        num_entries,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=8,
        num_stages=3,
        **gemm,
    )
    block = min(1024, next_pow2(hidden))
    launch(
        _moe_combine_kernel,
        (num_tokens, triton.cdiv(hidden, block)),
        entry_out,
        topk_ids,
        out,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HIDDEN=hidden,
        BLOCK=block,
    )
    return out
