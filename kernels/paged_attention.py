"""Attention over the paged KV cache (see kv_store.py for the layout).

Two shapes of work, both causal, both reading K/V only through block tables:
- decode: one query token per request, at position context_len - 1;
- prefill/extend: q_len new tokens per request (varlen, `cu_seqlens_q`), the last q_len of its
  context_len tokens; token i attends to positions [0, context_len - q_len + i].
The new tokens' K/V must already be stored (store_kv_cache) before either is called.
GQA: query head h reads kv head h // (num_heads // num_kv_heads).
A request with context_len 0 (empty) produces zeros.
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

ALL_HEADS_MAX_KV_HEADS = 4  # decode reference: above this, per-head products over transposed K/V


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_of_request] or [num_reqs, max_num_blocks]
) -> torch.Tensor:
    """K or V of whole blocks, in token order: [..., num_blocks_of_request * block_size, kvh, d].
    (index_select on the flattened table is an order of magnitude faster on CPU than fancy indexing.)"""
    blocks = cache.index_select(0, block_table.reshape(-1).long())  # [n * nb, block_size, kvh, d]
    return blocks.view(*block_table.shape[:-1], -1, *cache.shape[2:])


class DecodePlan:
    """What the decode attention of every layer of one round shares (block tables cut to the
    longest context, the padding mask): computed once per round (`plan_decode`), not per layer."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int):
        self.max_len = max_len = int(context_lens.max()) if context_lens.numel() else 0
        self.num_blocks = -(-max_len // block_size)
        self.tables = block_tables[:, : self.num_blocks].long()  # [num_reqs, num_blocks]
        pos = torch.arange(self.num_blocks * block_size, device=context_lens.device)
        masked = pos[None, :] >= context_lens[:, None]  # [num_reqs, num_blocks * block_size]
        self.masked = masked[:, None, None, :]  # broadcast over kv heads and query rows
        self.any_empty = max_len > 0 and int(context_lens.min()) == 0


def paged_decode_attention_ref(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    plan: DecodePlan | None = None,  # the round's, shared by its layers; None: computed here
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """The whole decode batch in two batched matmuls; softmax in float32. No causal mask is
    needed: every cached token precedes the query. A single request runs PyTorch's fused
    attention instead, its K/V cut to the context so that nothing is masked (SmolLM2's shapes,
    bf16: 27 against 85 us per layer; with a padding mask it takes a path slower than this one).

    With few kv heads (<= ALL_HEADS_MAX_KV_HEADS) each request's gathered K/V stay token-major as
    the cache holds them ([tokens * kv_heads, head_dim], contiguous): every query head is
    multiplied with every kv head and the matching scores are kept (the diagonal), then the
    probabilities are put back on that diagonal (zeros elsewhere) for the product with V. That
    spends num_kv_heads times the flops of a per-head product but no transposed copy of K/V,
    which is what dominates on the CPU (SmolLM2, 3 kv heads, 64 requests x 161 tokens: 2.8 ms
    per layer instead of 3.9). The kept scores are the per-head path's products and the extra terms
    of the V product are exact zeros, so the two paths agree (tested). Otherwise the `group` query heads sharing a kv head are laid out as
    `group` query rows of that head, over a transposed view of K/V."""
    num_reqs, num_heads, head_dim = query.shape
    if num_reqs == 0:
        return query.new_empty(query.shape)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    plan = plan or DecodePlan(block_tables, context_lens.to(query.device), block_size)
    if plan.num_blocks == 0:
        return torch.zeros_like(query)
    k, v = gather_kv(k_cache, plan.tables), gather_kv(v_cache, plan.tables)  # [num_reqs, len, kvh, d]
    if num_reqs == 1:  # one stream: K/V cut to its length, nothing to mask
        k, v = k[:, : plan.max_len].transpose(1, 2), v[:, : plan.max_len].transpose(1, 2)  # [1, kvh, len, d]
        out = F.scaled_dot_product_attention(
            query[:, :, None], k.to(query.dtype), v.to(query.dtype), scale=scale, enable_gqa=True
        )
        return out[:, :, 0]  # [1, heads, d]
    if num_kv_heads <= ALL_HEADS_MAX_KV_HEADS:
        length = k.shape[1]
        k = k.to(query.dtype).view(num_reqs, length * num_kv_heads, head_dim)
        v = v.to(query.dtype).view(num_reqs, length * num_kv_heads, head_dim)
        every = torch.bmm(query, k.transpose(1, 2)).view(num_reqs, num_kv_heads, group, length, num_kv_heads)
        scores = torch.diagonal(every, dim1=1, dim2=4).permute(0, 3, 1, 2)  # [num_reqs, kvh, g, len]
        probs = _masked_softmax(scores.float().mul_(scale), plan)
        spread = query.new_zeros(num_reqs, num_kv_heads, group, length, num_kv_heads)
        torch.diagonal(spread, dim1=1, dim2=4).copy_(probs.permute(0, 2, 3, 1))
        return torch.bmm(spread.view(num_reqs, num_heads, length * num_kv_heads), v)  # [num_reqs, heads, d]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [num_reqs, kvh, len, d]
    q = query.view(num_reqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float().mul_(scale)  # [num_reqs, kvh, g, len]
    probs = _masked_softmax(scores, plan)
    out = torch.matmul(probs.to(v.dtype), v)  # [num_reqs, kvh, g, d] -> heads in order
    return out.reshape(num_reqs, num_heads, head_dim).to(query.dtype)


def _masked_softmax(scores: torch.Tensor, plan: DecodePlan) -> torch.Tensor:  # [num_reqs, kvh, g, len]
    scores.masked_fill_(plan.masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if plan.any_empty:  # an empty request: its fully masked row is NaN
        probs = probs.nan_to_num_(0.0)
    return probs


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32, cached prefix + new tokens
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros_like(query)
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, context_len in enumerate(lens):  # one request at a time: few prefills per round
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0 or context_len == 0:
            continue
        num_blocks = -(-context_len // block_size)
        k = gather_kv(k_cache, block_tables[i, :num_blocks])[:context_len]  # [context_len, kvh, d]
        v = gather_kv(v_cache, block_tables[i, :num_blocks])[:context_len]
        q = query[q_start:q_end].transpose(0, 1)  # [num_heads, q_len, d]
        q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
        k_pos = torch.arange(context_len, device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [q_len, context_len]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [1, num_heads, q_len, d]
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Triton. Both kernels gather K/V token by token through the block table (any block_size works),
# run an online softmax in fp32 and keep the GQA group's query heads together in one tile.

if HAS_TRITON:

    @triton.jit
    def _paged_decode_partition_kernel(
        query_ptr,  # [num_reqs, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,
        block_tables_ptr,  # [num_reqs, max_num_blocks]
        context_lens_ptr,  # [num_reqs]
        partial_out_ptr,  # [num_reqs, num_heads, num_partitions, head_dim] fp32, normalized
        partial_lse_ptr,  # [num_reqs, num_heads, num_partitions] fp32, -inf for no token
        scale,
        query_req_stride,
        query_head_stride,
        block_table_stride,
        num_partitions,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,  # num_heads // num_kv_heads
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PARTITION_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + req)
        group = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + group
        head_mask = group < GROUP
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q_ptrs = query_ptr + req.to(tl.int64) * query_req_stride + heads[:, None] * query_head_stride + dims[None, :]
        q = tl.load(q_ptrs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        if UPCAST_DOT:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, context_len)
        table = block_tables_ptr + req.to(tl.int64) * block_table_stride
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_offsets = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            kv_mask = valid[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if UPCAST_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_H, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        has_tokens = l > 0
        out = acc / tl.where(has_tokens, l, 1.0)[:, None]
        lse = tl.where(has_tokens, m + tl.log(tl.where(has_tokens, l, 1.0)), float("-inf"))
        row = (req * GROUP * NUM_KV_HEADS + heads).to(tl.int64) * num_partitions + part  # [BLOCK_H]
        tl.store(partial_lse_ptr + row, lse, mask=head_mask)
        tl.store(
            partial_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=head_mask[:, None] & dim_mask[None, :]
        )

    @triton.jit
    def _paged_decode_reduce_kernel(
        partial_out_ptr,  # [num_reqs * num_heads, num_partitions, head_dim] fp32
        partial_lse_ptr,  # [num_reqs * num_heads, num_partitions] fp32
        out_ptr,  # [num_reqs * num_heads, head_dim]
        num_partitions,
        HEAD_DIM: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # req * num_heads + head
        parts = tl.arange(0, BLOCK_P)
        part_mask = parts < num_partitions
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        lse = tl.load(partial_lse_ptr + row * num_partitions + parts, mask=part_mask, other=float("-inf"))
        has_tokens = lse != float("-inf")
        m = tl.max(tl.where(has_tokens, lse, -3.0e38), 0)  # finite even for an empty request
        w = tl.where(has_tokens, tl.exp(lse - m), 0.0)  # [BLOCK_P]
        o_ptrs = partial_out_ptr + (row * num_partitions + parts)[:, None] * HEAD_DIM + dims[None, :]
        o = tl.load(o_ptrs, mask=part_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_P, BLOCK_D]
        total = tl.sum(w, 0)
        out = tl.sum(tl.where(has_tokens[:, None], w[:, None] * o, 0.0), 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)

    @triton.jit
    def _paged_prefill_kernel(
        query_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,
        cu_seqlens_q_ptr,  # [num_reqs + 1]
        context_lens_ptr,  # [num_reqs]
        block_tables_ptr,  # [num_reqs, max_num_blocks]
        out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
        scale,
        query_token_stride,
        query_head_stride,
        block_table_stride,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        req = tl.program_id(0)
        tile = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + req)
        q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
        if tile * BLOCK_M >= q_len:
            return
        context_len = tl.load(context_lens_ptr + req)
        prefix_len = context_len - q_len
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = prefix_len + rows  # [BLOCK_M] absolute positions
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        tokens = (q_start + rows).to(tl.int64)
        q_ptrs = query_ptr + tokens[:, None] * query_token_stride + head * query_head_stride + dims[None, :]
        q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST_DOT:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = tl.minimum(context_len, prefix_len + tile * BLOCK_M + BLOCK_M)  # causal bound of the tile
        table = block_tables_ptr + req.to(tl.int64) * block_table_stride
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < kv_end
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_offsets = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            kv_mask = valid[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if UPCAST_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every row allows position 0 in tile 0
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        o_ptrs = out_ptr + (tokens[:, None] * NUM_HEADS + head) * HEAD_DIM + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def _check_paged_inputs(name, query, k_cache, v_cache, block_tables, context_lens, num_reqs) -> None:
    check_launchable(name, query, k_cache, v_cache, block_tables, context_lens)
    if k_cache.dim() != 4:
        raise ValueError(
            f"{name}: k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {list(k_cache.shape)}"
        )
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_shape(name, "v_cache", v_cache, tuple(k_cache.shape))
    check_shape(name, "query", query, (None, None, head_dim))
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(f"{name}: num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    check_dtype(name, "query", query, (torch.float16, torch.bfloat16, torch.float32))
    for what, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != query.dtype:
            raise ValueError(f"{name}: {what} dtype {t.dtype} differs from query dtype {query.dtype}")
        check_contiguous(name, what, t)
    check_inner_contiguous(name, "query", query, 1)
    check_shape(name, "block_tables", block_tables, (num_reqs, None))
    check_shape(name, "context_lens", context_lens, (num_reqs,))
    check_dtype(name, "block_tables", block_tables, (torch.int32,))
    check_dtype(name, "context_lens", context_lens, (torch.int32,))
    check_inner_contiguous(name, "block_tables", block_tables, 1)
    check_contiguous(name, "context_lens", context_lens)


def paged_decode_attention_triton(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    partition_size: int = 256,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, head_dim]
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    """Split-K (flash-decoding): one program per (request, kv head, partition of the context),
    then a reduce over partitions by log-sum-exp. The number of partitions comes from the block
    table's width (max_num_blocks * block_size), not from the context lengths: no host sync."""
    name = "paged_decode_attention_triton"
    num_reqs, num_heads, head_dim = query.shape
    _check_paged_inputs(name, query, k_cache, v_cache, block_tables, context_lens, num_reqs)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"{name}: partition_size must be a power of two >= 16, got {partition_size}")
    out = check_out(name, out, query, (num_reqs, num_heads, head_dim))
    if num_reqs == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_context = max(1, block_tables.shape[1] * block_size)
    num_partitions = triton.cdiv(max_context, partition_size)
    block_d = max(16, next_pow2(head_dim))
    partial_out = scratch((num_reqs, num_heads, num_partitions, head_dim), torch.float32, query.device)
    partial_lse = scratch((num_reqs, num_heads, num_partitions), torch.float32, query.device)
    launch(
        _paged_decode_partition_kernel,
        (num_reqs, num_kv_heads, num_partitions),
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_lse,
        float(scale),
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        num_partitions,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=partition_size,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_D=block_d,
        BLOCK_N=min(64, partition_size),
        UPCAST_DOT=upcast_dot(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
    )
    launch(
        _paged_decode_reduce_kernel,
        (num_reqs * num_heads,),
        partial_out,
        partial_lse,
        out,
        num_partitions,
        HEAD_DIM=head_dim,
        BLOCK_P=next_pow2(num_partitions),
        BLOCK_D=block_d,
    )
    return out


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32, cached prefix + new tokens
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    scale: float,
    max_q_len: int | None = None,
    block_m: int = 64,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """One program per (request, tile of block_m new tokens, query head), causal over the request's
    context through its block table. Without `max_q_len` the query offsets are read back and
    validated on the host (one sync)."""
    name = "paged_prefill_attention_triton"
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = context_lens.shape[0]
    _check_paged_inputs(name, query, k_cache, v_cache, block_tables, context_lens, num_reqs)
    check_shape(name, "cu_seqlens_q", cu_seqlens_q, (num_reqs + 1,))
    check_dtype(name, "cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    check_contiguous(name, "cu_seqlens_q", cu_seqlens_q)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"{name}: block_m must be a power of two >= 16, got {block_m}")
    if max_q_len is None:
        starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        if starts[0] != 0 or starts[-1] != num_tokens or min(q_lens, default=0) < 0:
            raise ValueError(f"{name}: cu_seqlens_q must rise from 0 to num_tokens={num_tokens}, got {starts}")
        if any(q > c for q, c in zip(q_lens, lens)):
            raise ValueError(
                f"{name}: a request has more new tokens than context: q_lens {q_lens}, context_lens {lens}"
            )
        max_q_len = max(q_lens, default=0)
    out = check_out(name, out, query, (num_tokens, num_heads, head_dim))
    if num_tokens == 0 or max_q_len == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    launch(
        _paged_prefill_kernel,
        (num_reqs, triton.cdiv(max_q_len, block_m), num_heads),
        query,
        k_cache,
        v_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        out,
        float(scale),
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=max(16, next_pow2(head_dim)),
        UPCAST_DOT=upcast_dot(query.dtype),
        DOT_PRECISION=dot_precision(query.dtype),
    )
    return out
