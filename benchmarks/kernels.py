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
PEAK_FP8_FLOPS = 2 * PEAK_FLOPS  # assumed: the dense fp8 tensor-core rate is twice bf16 (not measured here)
FP8_HEADERS = ["case", "impl", "median ms", "GB/s", "TFLOP/s", "roofline ms", "% roofline"]
DTYPE = torch.bfloat16
DEVICE = "cuda"


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3  # seconds


def row(case: str, impl: str, seconds: float, num_bytes: float, flops: float) -> list:
    gbs, tflops = num_bytes / seconds / 1e9, flops / seconds / 1e12
    return [
        case,
        impl,
        f"{seconds * 1e3:.3f}",
        f"{gbs:.0f}",
        f"{100 * gbs * 1e9 / PEAK_BYTES_PER_S:.0f}%",
        f"{tflops:.1f}",
        f"{100 * tflops * 1e12 / PEAK_FLOPS:.0f}%",
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


def moe_case(
    rows: list, name: str, num_experts: int, top_k: int, hidden: int, inter: int, num_tokens: int = 4096
) -> None:
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


def fp8_row(case: str, impl: str, seconds: float, num_bytes: float, flops: float, peak_flops: float) -> list:
    roofline = max(num_bytes / PEAK_BYTES_PER_S, flops / peak_flops)
    return [
        case,
        impl,
        f"{seconds * 1e3:.3f}",
        f"{num_bytes / seconds / 1e9:.0f}",
        f"{flops / seconds / 1e12:.1f}",
        f"{roofline * 1e3:.3f}",
        f"{100 * roofline / seconds:.0f}%",
    ]


def random_fp8_weight(*shape: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] e4m3 filled one matrix at a time (no fp32 copy of the whole), and its scales."""
    from moemesh.kernels.fp8 import FP8_DTYPE, cdiv

    *lead, n, k = shape
    weight = torch.empty(shape, dtype=FP8_DTYPE, device=DEVICE)
    for matrix in weight.view(-1, n, k):
        matrix.copy_(torch.randn(n, k, device=DEVICE, dtype=DTYPE).clamp(-448, 448))
    scale_inv = torch.rand(*lead, cdiv(n, block), cdiv(k, block), device=DEVICE) * k**-0.5 + 0.5 * k**-0.5
    return weight, scale_inv


def bf16_weight(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The dequantized weight in bf16, one matrix at a time."""
    from moemesh.kernels.fp8 import block_dequant_ref

    n, k = weight.shape[-2:]
    out = torch.empty(weight.shape, dtype=DTYPE, device=DEVICE)
    for dst, w, s in zip(out.view(-1, n, k), weight.view(-1, n, k), scale_inv.view(-1, *scale_inv.shape[-2:])):
        dst.copy_(block_dequant_ref(w, s, dtype=DTYPE))
    return out


def fp8_gemm_case(rows: list, name: str, n: int, k: int, ms=(1, 16, 64, 4096)) -> None:
    from moemesh.kernels.fp8 import act_quant_triton
    from moemesh.kernels.fp8_gemm import fp8_gemm_triton, fp8_linear_triton, fp8_linear_w8a8_ref

    weight, scale_inv = random_fp8_weight(n, k)  # [N, K] e4m3, [N / 128, K / 128]
    w_bf16 = bf16_weight(weight, scale_inv)  # [N, K]
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)  # [M, K]
        x_q, x_scale = act_quant_triton(x)
        linear_fn = lambda: fp8_linear_triton(x, weight, scale_inv)  # noqa: E731
        gemm_fn = lambda: fp8_gemm_triton(x_q, x_scale, weight, scale_inv, DTYPE)  # noqa: E731
        cublas_fn = lambda: x @ w_bf16.t()  # noqa: E731
        check(f"fp8 linear {name} M={m}", linear_fn(), fp8_linear_w8a8_ref(x, weight, scale_inv))
        check(f"fp8 linear {name} M={m} vs bf16", linear_fn(), cublas_fn(), tol=5e-2)
        flops = 2 * m * n * k
        act_bytes = m * k * 2 + m * n * 2
        fp8_bytes = n * k + scale_inv.numel() * 4 + act_bytes
        case = f"fp8 gemm {name} M={m}"
        rows.append(fp8_row(case, "triton w8a8 (+act quant)", bench(linear_fn), fp8_bytes, flops, PEAK_FP8_FLOPS))
        rows.append(fp8_row(case, "triton w8a8 gemm only", bench(gemm_fn), fp8_bytes, flops, PEAK_FP8_FLOPS))
        rows.append(fp8_row(case, "cublas bf16", bench(cublas_fn), 2 * n * k + act_bytes, flops, PEAK_FLOPS))


def fp8_moe_case(rows: list, tokens=(1, 16, 64, 4096), num_experts=256, top_k=8, hidden=7168, inter=2048) -> None:
    from moemesh.kernels.fp8_moe import fp8_fused_moe_triton, fp8_fused_moe_w8a8_ref
    from moemesh.kernels.moe import fused_moe_ref, fused_moe_triton

    w13, w13_scale_inv = random_fp8_weight(num_experts, 2 * inter, hidden)  # DeepSeek-V3: 7.5 GB
    w2, w2_scale_inv = random_fp8_weight(num_experts, hidden, inter)
    w13_bf16, w2_bf16 = bf16_weight(w13, w13_scale_inv), bf16_weight(w2, w2_scale_inv)  # 22.5 GB together
    fp8_weights = (w13, w13_scale_inv, w2, w2_scale_inv)
    for t in tokens:
        x = torch.randn(t, hidden, device=DEVICE, dtype=DTYPE)  # [num_tokens, hidden]
        topk_weights, topk_ids = torch.rand(t, num_experts, device=DEVICE).softmax(-1).topk(top_k)
        topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()  # [num_tokens, top_k]
        fp8_fn = lambda: fp8_fused_moe_triton(x, *fp8_weights, topk_weights, topk_ids)  # noqa: E731
        bf16_fn = lambda: fused_moe_triton(x, w13_bf16, w2_bf16, topk_weights, topk_ids)  # noqa: E731
        cublas_fn = lambda: fused_moe_ref(x, w13_bf16, w2_bf16, topk_weights, topk_ids)  # noqa: E731
        if t <= 64:
            check(f"fp8 moe T={t}", fp8_fn(), fp8_fused_moe_w8a8_ref(x, *fp8_weights, topk_weights, topk_ids))
        check(f"fp8 moe T={t} vs bf16", fp8_fn(), bf16_fn(), tol=5e-2)
        active = topk_ids.unique().numel()  # experts whose weights must be read
        flops = 6 * t * top_k * hidden * inter
        act_bytes = 2 * t * hidden * 2
        case = f"fp8 moe dsv3 E={num_experts} top{top_k} T={t} ({active} experts)"
        fp8_bytes = active * (3 * hidden * inter + 4 * (w13_scale_inv[0].numel() + w2_scale_inv[0].numel())) + act_bytes
        rows.append(fp8_row(case, "triton fp8 fused", bench(fp8_fn), fp8_bytes, flops, PEAK_FP8_FLOPS))
        rows.append(
            fp8_row(
                case, "triton bf16 fused", bench(bf16_fn), active * 6 * hidden * inter + act_bytes, flops, PEAK_FLOPS
            )
        )
        rows.append(
            fp8_row(
                case,
                "cublas bf16 per-expert",
                bench(cublas_fn),
                active * 6 * hidden * inter + act_bytes,
                flops,
                PEAK_FLOPS,
            )
        )


def fp8_tables() -> None:
    print(f"fp8 roofline: {PEAK_BYTES_PER_S / 1e12} TB/s, {PEAK_FP8_FLOPS / 1e12:.0f} TFLOP/s fp8 (assumed 2x bf16)")
    rows: list = []
    fp8_gemm_case(rows, "gate_up 4096x7168", 2 * 2048, 7168)
    fp8_gemm_case(rows, "down 7168x2048", 7168, 2048)
    fp8_moe_case(rows)
    print_table(FP8_HEADERS, rows)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/kernels.py needs a CUDA GPU (the Triton kernels are CPU-tested under TRITON_INTERPRET=1)"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks/kernels.py needs triton: pip install -e '.[kernels]'") from None
    torch.manual_seed(0)
    print(
        f"device: {torch.cuda.get_device_name()}; ceilings {PEAK_BYTES_PER_S / 1e12} TB/s, {PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16"
    )
    if sys.argv[1:] == ["fp8"]:
        fp8_tables()
        return
    rows: list = []
    decode_case(rows)
    prefill_case(rows)
    moe_case(rows, "qwen3-30b-a3b", num_experts=128, top_k=8, hidden=2048, inter=768)
    moe_case(rows, "mixtral-8x7b", num_experts=8, top_k=2, hidden=4096, inter=14336)
    print_table(["case", "impl", "median ms", "GB/s", "% BW", "TFLOP/s", "% bf16 peak"], rows)
    fp8_tables()


if __name__ == "__main__":
    main()
