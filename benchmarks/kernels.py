"""Triton kernels vs torch peers on one CUDA GPU, same run: correctness first, then timings.

    python benchmarks/kernels.py

Each case checks the Triton launcher against the torch reference at the benchmark size, then
times it and its peer with `triton.testing.do_bench` (median) and prints achieved GB/s and
TFLOP/s against the H200's measured ceilings. Cases: paged decode attention (64 requests x 4k
context; peer: torch SDPA on the same K/V stored contiguously), prefill attention (peer: causal
SDPA), fused MoE at 4096 tokens (peers: the reference's per-expert torch matmuls, and one dense
torch matmul chain of the same FLOPs, an upper bound for any grouped GEMM).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table  # noqa: E402

PEAK_BYTES_PER_S = 4.3e12  # H200 measured copy bandwidth
PEAK_FLOPS = 790e12  # H200 measured dense bf16 matmul
DTYPE = torch.bfloat16
DEVICE = "cuda"


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3  # seconds


def row(case: str, impl: str, seconds: float, num_bytes: float, flops: float) -> list:
    gbs, tflops = num_bytes / seconds / 1e9, flops / seconds / 1e12
    return [
        case, impl, f"{seconds * 1e3:.3f}", f"{gbs:.0f}", f"{100 * gbs * 1e9 / PEAK_BYTES_PER_S:.0f}%",
        f"{tflops:.1f}", f"{100 * tflops * 1e12 / PEAK_FLOPS:.0f}%",
    ]


def check(name: str, out: torch.Tensor, expected: torch.Tensor, tol: float = 2e-2) -> None:
    err = (out.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    status = "ok" if err <= tol * max(1.0, scale) else "MISMATCH"
    print(f"correctness {name}: max abs err {err:.2e} (max |ref| {scale:.2e}) {status}")
    if status != "ok":
        raise SystemExit(f"{name}: Triton output differs from the reference")


def paged_cache(num_reqs: int, context: int, num_kv_heads: int, head_dim: int, block_size: int = 16):
    """Random K/V in shuffled blocks; also returned contiguous for the SDPA peer."""
    blocks_per_req = context // block_size
    num_blocks = num_reqs * blocks_per_req + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, device=DEVICE) + 1).view(num_reqs, blocks_per_req).int()
    k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()  # [num_reqs, kvh, context, d]
    v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    return k_cache, v_cache, tables, k, v


def decode_case(rows: list, num_reqs=64, context=4096, heads=32, kv_heads=8, d=128) -> None:
    from moemesh.kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton

    k_cache, v_cache, tables, k, v = paged_cache(num_reqs, context, kv_heads, d)
    q = torch.randn(num_reqs, heads, d, device=DEVICE, dtype=DTYPE)  # [num_reqs, num_heads, head_dim]
    lens = torch.full((num_reqs,), context, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    triton_fn = lambda: paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale)  # noqa: E731
    sdpa_fn = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)  # noqa: E731
    check("paged decode", triton_fn(), paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale))
    check("paged decode vs sdpa", triton_fn(), sdpa_fn()[:, :, 0])
    num_bytes = 2 * num_reqs * context * kv_heads * d * 2 + 2 * q.numel() * 2
    flops = 4 * num_reqs * heads * context * d
    case = f"decode {num_reqs}x{context} h{heads}/{kv_heads}"
    rows.append(row(case, "triton paged split-K", bench(triton_fn), num_bytes, flops))
    rows.append(row(case, "torch sdpa contiguous", bench(sdpa_fn), num_bytes, flops))


def prefill_case(rows: list, num_reqs=8, q_len=2048, heads=32, kv_heads=8, d=128) -> None:
    from moemesh.kernels.paged_attention import paged_prefill_attention_ref, paged_prefill_attention_triton

    k_cache, v_cache, tables, k, v = paged_cache(num_reqs, q_len, kv_heads, d)
    q = torch.randn(num_reqs * q_len, heads, d, device=DEVICE, dtype=DTYPE)  # [num_tokens, num_heads, head_dim]
    cu = torch.arange(0, num_reqs + 1, device=DEVICE, dtype=torch.int32) * q_len
    lens = torch.full((num_reqs,), q_len, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    args = (q, k_cache, v_cache, cu, lens, tables, scale)
    triton_fn = lambda: paged_prefill_attention_triton(*args, max_q_len=q_len)  # noqa: E731
    q_sdpa = q.view(num_reqs, q_len, heads, d).transpose(1, 2)
    sdpa_fn = lambda: F.scaled_dot_product_attention(q_sdpa, k, v, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
    check("paged prefill", triton_fn(), paged_prefill_attention_ref(*args))
    flops = 4 * num_reqs * heads * d * q_len * (q_len + 1) / 2
    num_bytes = (2 * q.numel() + 2 * k.numel()) * 2
    case = f"prefill {num_reqs}x{q_len} causal"
    rows.append(row(case, "triton paged", bench(triton_fn), num_bytes, flops))
    rows.append(row(case, "torch sdpa contiguous", bench(sdpa_fn), num_bytes, flops))


def moe_case(rows: list, name: str, num_experts: int, top_k: int, hidden: int, inter: int, num_tokens: int = 4096) -> None:
    from moemesh.kernels.moe import fused_moe_ref, fused_moe_triton

    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=DTYPE)  # [num_tokens, hidden]
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, dtype=DTYPE) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, device=DEVICE, dtype=DTYPE) * inter**-0.5
    topk_weights, topk_ids = torch.rand(num_tokens, num_experts, device=DEVICE).softmax(-1).topk(top_k)
    topk_ids = topk_ids.contiguous()  # [num_tokens, top_k] int64
    topk_weights = topk_weights.contiguous()
    triton_fn = lambda: fused_moe_triton(x, w13, w2, topk_weights, topk_ids)  # noqa: E731
    ref_fn = lambda: fused_moe_ref(x, w13, w2, topk_weights, topk_ids)  # noqa: E731
    rows_x = torch.randn(num_tokens * top_k, hidden, device=DEVICE, dtype=DTYPE)  # dense peer: one expert, all rows
    dense_fn = lambda: (F.silu(rows_x @ w13[0, :inter].t()) * (rows_x @ w13[0, inter:].t())) @ w2[0].t()  # noqa: E731
    check(f"fused moe {name}", triton_fn(), ref_fn())
    flops = 6 * num_tokens * top_k * hidden * inter
    num_bytes = 3 * num_experts * hidden * inter * 2 + 2 * num_tokens * hidden * 2  # weights once + x + out
    case = f"moe {name} T={num_tokens}"
    rows.append(row(case, "triton fused", bench(triton_fn), num_bytes, flops))
    rows.append(row(case, "torch per-expert (ref)", bench(ref_fn), num_bytes, flops))
    rows.append(row(case, "torch dense same FLOPs", bench(dense_fn), num_bytes, flops))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU (the Triton kernels are CPU-tested under TRITON_INTERPRET=1)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/kernels.py needs triton: pip install -e '.[kernels]'") from None
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; ceilings {PEAK_BYTES_PER_S / 1e12} TB/s, {PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16")
    rows: list = []
    decode_case(rows)
    prefill_case(rows)
    moe_case(rows, "qwen3-30b-a3b", num_experts=128, top_k=8, hidden=2048, inter=768)
    moe_case(rows, "mixtral-8x7b", num_experts=8, top_k=2, hidden=4096, inter=14336)
    print_table(["case", "impl", "median ms", "GB/s", "% BW", "TFLOP/s", "% bf16 peak"], rows)


if __name__ == "__main__":
    main()
