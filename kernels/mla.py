"""MLA (DeepSeek-V2/V3 multi-head latent attention) decode over the paged latent cache.

Cache: kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] holds per token the
compressed latent c (kv_lora_rank, after kv_a_layernorm) followed by the rotated shared rope key
k_rope; one "head" shared by all query heads. (A [num_blocks, block_size, 1, D] cache, as
store_kv_cache writes it with num_kv_heads=1, is accepted too.) Slots and block tables as in
kv_store.py.

Absorbed-weight form: with kv_b_proj split per head into W_UK [qk_nope_head_dim, kv_lora_rank]
and W_UV [v_head_dim, kv_lora_rank], the caller passes q_latent[h] = q_nope[h] @ W_UK[h] and
q_rope[h] (rotated); then
    score[h, t] = scale * (q_latent[h] . c[t] + q_rope[h] . k_rope[t])
    out[h] = sum_t softmax_t(score[h, :]) c[t]        (in latent space, [kv_lora_rank])
and the caller applies W_UV[h] (out[h] @ W_UV[h]^T) before o_proj. `scale` is the model's
softmax scale (1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times the YaRN mscale^2 if any).
A request with context_len 0 produces zeros.
"""

import torch

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


def _latent_cache(kv_cache: torch.Tensor) -> torch.Tensor:  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        return kv_cache.squeeze(2)
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], got {list(kv_cache.shape)}"
        )
    return kv_cache


def mla_decode_attention_ref(
    q_latent: torch.Tensor,  # [num_reqs, num_heads, kv_lora_rank]
    q_rope: torch.Tensor,  # [num_reqs, num_heads, qk_rope_head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
) -> torch.Tensor:  # [num_reqs, num_heads, kv_lora_rank]
    kv_cache = _latent_cache(kv_cache)
    num_reqs, num_heads, kv_lora_rank = q_latent.shape
    if num_reqs == 0:
        return q_latent.new_empty(q_latent.shape)
    block_size = kv_cache.shape[1]
    max_len = int(context_lens.max())
    num_blocks = max(1, -(-max_len // block_size))
    kv = kv_cache[block_tables[:, :num_blocks].long()].flatten(1, 2)[:, :max_len]  # [num_reqs, max_len, D]
    c, k_rope = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    scores = torch.einsum("bhl,bnl->bhn", q_latent, c.to(q_latent.dtype)).float()
    scores += torch.einsum("bhr,bnr->bhn", q_rope, k_rope.to(q_rope.dtype)).float()
    scores *= scale  # [num_reqs, num_heads, max_len]
    pos = torch.arange(max_len, device=q_latent.device)
    mask = pos[None, :] >= context_lens[:, None].to(q_latent.device)  # [num_reqs, max_len]
    scores.masked_fill_(mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(c.dtype)
    return torch.einsum("bhn,bnl->bhl", probs, c).to(q_latent.dtype)


if HAS_TRITON:
    from moemesh.kernels.paged_attention import _paged_decode_reduce_kernel

    @triton.jit
    def _mla_decode_partition_kernel(
        q_latent_ptr,  # [num_reqs, num_heads, kv_lora_rank], dense heads
        q_rope_ptr,  # [num_reqs, num_heads, rope_dim], dense heads
        kv_cache_ptr,  # [num_blocks, block_size, kv_lora_rank + rope_dim], contiguous
        block_tables_ptr,  # [num_reqs, max_num_blocks]
        context_lens_ptr,  # [num_reqs]
        partial_out_ptr,  # [num_reqs, num_heads, num_partitions, kv_lora_rank] fp32, normalized
        partial_lse_ptr,  # [num_reqs, num_heads, num_partitions] fp32
        scale,
        q_latent_req_stride,
        q_latent_head_stride,
        q_rope_req_stride,
        q_rope_head_stride,
        block_table_stride,
        num_partitions,
        NUM_HEADS: tl.constexpr,
        LORA_RANK: tl.constexpr,
        ROPE_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PARTITION_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        req = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        part = tl.program_id(2)
        head_mask = heads < NUM_HEADS
        context_len = tl.load(context_lens_ptr + req)
        lat = tl.arange(0, BLOCK_L)
        lat_mask = lat < LORA_RANK
        rot = tl.arange(0, BLOCK_R)
        rot_mask = rot < ROPE_DIM
        req64 = req.to(tl.int64)
        q_l = tl.load(
            q_latent_ptr + req64 * q_latent_req_stride + heads[:, None] * q_latent_head_stride + lat[None, :],
            mask=head_mask[:, None] & lat_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_L]
        q_r = tl.load(
            q_rope_ptr + req64 * q_rope_req_stride + heads[:, None] * q_rope_head_stride + rot[None, :],
            mask=head_mask[:, None] & rot_mask[None, :],
            other=0.0,
        )  # [BLOCK_H, BLOCK_R]
        if UPCAST_DOT:
            q_l = q_l.to(tl.float32)
            q_r = q_r.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, context_len)
        table = block_tables_ptr + req64 * block_table_stride
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            row = kv_cache_ptr + (block * BLOCK_SIZE + pos % BLOCK_SIZE) * (LORA_RANK + ROPE_DIM)  # [BLOCK_N]
            c = tl.load(row[:, None] + lat[None, :], mask=valid[:, None] & lat_mask[None, :], other=0.0)
            k_r = tl.load(row[:, None] + LORA_RANK + rot[None, :], mask=valid[:, None] & rot_mask[None, :], other=0.0)
            if UPCAST_DOT:
                c = c.to(tl.float32)
                k_r = k_r.to(tl.float32)
            s = tl.dot(q_l, tl.trans(c), input_precision=DOT_PRECISION)
            s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION) * scale  # [BLOCK_H, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
            m = m_new
        has_tokens = l > 0
        out = acc / tl.where(has_tokens, l, 1.0)[:, None]
        lse = tl.where(has_tokens, m + tl.log(tl.where(has_tokens, l, 1.0)), float("-inf"))
        out_row = (req * NUM_HEADS + heads).to(tl.int64) * num_partitions + part  # [BLOCK_H]
        tl.store(partial_lse_ptr + out_row, lse, mask=head_mask)
        tl.store(
            partial_out_ptr + out_row[:, None] * LORA_RANK + lat[None, :],
            out,
            mask=head_mask[:, None] & lat_mask[None, :],
        )


def mla_decode_attention_triton(
    q_latent: torch.Tensor,  # [num_reqs, num_heads, kv_lora_rank]
    q_rope: torch.Tensor,  # [num_reqs, num_heads, qk_rope_head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    partition_size: int = 256,
    out: torch.Tensor | None = None,  # [num_reqs, num_heads, kv_lora_rank]
) -> torch.Tensor:  # [num_reqs, num_heads, kv_lora_rank]
    """Split-K like paged_decode_attention_triton (and sharing its reduce kernel): one program per
    (request, 16 query heads, partition of the context). Each program reads its partition's latent
    rows once, so with 128 heads every row is read 8 times (L2 absorbs part of it); a FlashMLA-style
    kernel holding 64-128 heads per program (split over warps) would read it once."""
    name = "mla_decode_attention_triton"
    check_launchable(name, q_latent, q_rope, kv_cache, block_tables, context_lens)
    try:
        kv_cache = _latent_cache(kv_cache)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    num_reqs, num_heads, kv_lora_rank = q_latent.shape
    rope_dim = kv_cache.shape[2] - kv_lora_rank
    check_shape(name, "q_rope", q_rope, (num_reqs, num_heads, None))
    if rope_dim < 1 or q_rope.shape[2] != rope_dim:
        raise ValueError(
            f"{name}: kv_cache rows ({kv_cache.shape[2]}) must be kv_lora_rank ({kv_lora_rank}) + rope dim ({q_rope.shape[2]})"
        )
    check_dtype(name, "q_latent", q_latent, (torch.float16, torch.bfloat16, torch.float32))
    for what, t in (("q_rope", q_rope), ("kv_cache", kv_cache)):
        if t.dtype != q_latent.dtype:
            raise ValueError(f"{name}: {what} dtype {t.dtype} differs from q_latent dtype {q_latent.dtype}")
    check_inner_contiguous(name, "q_latent", q_latent, 1)
    check_inner_contiguous(name, "q_rope", q_rope, 1)
    check_contiguous(name, "kv_cache", kv_cache)
    check_shape(name, "block_tables", block_tables, (num_reqs, None))
    check_shape(name, "context_lens", context_lens, (num_reqs,))
    check_dtype(name, "block_tables", block_tables, (torch.int32,))
    check_dtype(name, "context_lens", context_lens, (torch.int32,))
    check_inner_contiguous(name, "block_tables", block_tables, 1)
    check_contiguous(name, "context_lens", context_lens)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"{name}: partition_size must be a power of two >= 16, got {partition_size}")
    out = check_out(name, out, q_latent, (num_reqs, num_heads, kv_lora_rank))
    if num_reqs == 0:
        return out
    block_size = kv_cache.shape[1]
    num_partitions = triton.cdiv(max(1, block_tables.shape[1] * block_size), partition_size)
    block_h, block_l = 16, max(16, next_pow2(kv_lora_rank))
    partial_out = scratch((num_reqs, num_heads, num_partitions, kv_lora_rank), torch.float32, q_latent.device)
    partial_lse = scratch((num_reqs, num_heads, num_partitions), torch.float32, q_latent.device)
    launch(
        _mla_decode_partition_kernel,
        (num_reqs, triton.cdiv(num_heads, block_h), num_partitions),
        q_latent,
        q_rope,
        kv_cache,
        block_tables,
        context_lens,
        partial_out,
        partial_lse,
        float(scale),
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        block_tables.stride(0),
        num_partitions,
        NUM_HEADS=num_heads,
        LORA_RANK=kv_lora_rank,
        ROPE_DIM=rope_dim,
        BLOCK_SIZE=block_size,
        PARTITION_SIZE=partition_size,
        BLOCK_H=block_h,
        BLOCK_L=block_l,
        BLOCK_R=max(16, next_pow2(rope_dim)),
        BLOCK_N=min(32, partition_size),
        UPCAST_DOT=upcast_dot(q_latent.dtype),
        DOT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=8 if block_l >= 256 else 4,
    )
    launch(
        _paged_decode_reduce_kernel,
        (num_reqs * num_heads,),
        partial_out,
        partial_lse,
        out,
        num_partitions,
        HEAD_DIM=kv_lora_rank,
        BLOCK_P=next_pow2(num_partitions),
        BLOCK_D=block_l,
    )
    return out
