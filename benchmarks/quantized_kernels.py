"""Weight-only quantized CPU matmuls on SmolLM2-135M's projection shapes, against dense float32 /
bfloat16, at M = 1 (one decoding request) and M = 64 (a full decode round).

    python benchmarks/quantized_kernels.py [--iters 20]

Columns: dense F.linear; `_weight_int4pack_mm_for_cpu` (group 32, as Q4_0/Q4_1/Q4_K use, bf16
only), which layers/quantized_linear.py runs at M <= 8, and above that W^T rebuilt from its layout
by kernels/csrc/group_gemv.c plus a dense bf16 matmul; one `_weight_int8pack_mm` per 32-column group
(Q8_0 has a scale per group, the kernel one per row: the form this replaced); the C GEMV on Q8_0
codes (bf16 x) and Q4_1 nibbles (float32 x), run at M <= 8; and its dequantize-per-call (the C
rebuild + dense), run above that. Microseconds per call, best of 3 repeats;
the CPU flags that decide which kernels are vectorized are printed too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_flags, print_table  # noqa: E402

from moemesh import kernels  # noqa: E402
from moemesh.engine.layers.group_quantized import GroupQuantized  # noqa: E402
from moemesh.engine.layers.quantized_linear import QuantizedLinear  # noqa: E402

SHAPES = {
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def timed(fn, iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def weight(n: int, k: int, bits: int) -> GroupQuantized:
    gen = torch.Generator().manual_seed(0)
    groups = k // 32
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        return GroupQuantized(codes, 4, 32, torch.rand(n, groups) * 1e-2, -torch.rand(n, groups) * 1e-1, "Q4_1")
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return GroupQuantized(codes, 8, 32, torch.rand(n, groups) * 1e-3, None, "Q8_0")


def int8_groups(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One `_weight_int8pack_mm` per group: codes [G, N, group] int8, scales [G, N] bf16."""
    xg = x.view(x.shape[0], codes.shape[0], -1).transpose(0, 1).contiguous()  # [G, M, group]
    y = torch.ops.aten._weight_int8pack_mm(xg[0], codes[0], scales[0]).float()
    for g in range(1, codes.shape[0]):
        y += torch.ops.aten._weight_int8pack_mm(xg[g], codes[g], scales[g])
    return y.to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    has_gemv = kernels.quantized_kernels_built()
    rows = []
    for name, (n, k) in SHAPES.items():
        dense32 = torch.randn(n, k)
        dense16 = dense32.bfloat16()
        q4_bf16, q4_f32, q8_bf16 = QuantizedLinear(k, n), QuantizedLinear(k, n), QuantizedLinear(k, n)
        q4_bf16.load(weight(n, k, 4), torch.bfloat16)
        q4_f32.load(weight(n, k, 4), torch.float32)
        q8 = weight(n, k, 8)
        q8_bf16.load(q8, torch.bfloat16)
        groups_codes = q8.codes.view(n, k // 32, 32).transpose(0, 1).contiguous()  # [G, N, 32]
        groups_scales = q8.scale.T.bfloat16().contiguous()  # [G, N]
        for m in (1, 64):
            iters = max(2, args.iters // (8 if name == "lm_head" else 1) // (4 if m == 64 else 1))
            x32 = torch.randn(m, k)
            x16 = x32.bfloat16()
            cells = {
                "dense fp32": timed(lambda: F.linear(x32, dense32), iters),
                "dense bf16": timed(lambda: F.linear(x16, dense16), iters),
                "int4pack bf16": timed(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, q4_bf16.packed, 32, q4_bf16.scales_zeros),
                    iters,
                ),
                "int4pack dequant+dense bf16": timed(lambda: q4_bf16._int4pack_dequantized_matmul(x16), iters)
                if q4_bf16.block_n
                else float("nan"),
                "int8 groups bf16": timed(lambda: int8_groups(x16, groups_codes, groups_scales), iters),
                "C int8 bf16": timed(lambda: kernels.quantized_gemv(x16, q8_bf16.codes, q8_bf16.scales), iters)
                if has_gemv
                else float("nan"),
                "C q4 fp32": timed(lambda: kernels.quantized_gemv(x32, q4_f32.codes, q4_f32.scales, q4_f32.mins), iters)
                if has_gemv
                else float("nan"),
                "C int8 dequant+dense bf16": timed(lambda: q8_bf16._dequantized_matmul(x16), max(2, iters // 4)),
                "C q4 dequant+dense fp32": timed(lambda: q4_f32._dequantized_matmul(x32), max(2, iters // 4)),
            }
            rows.append([name, f"{n}x{k}", m, *(f"{v:.0f}" for v in cells.values())])
            print_table(["projection", "N x K", "M", *cells], rows)
    print(
        f"\nmicroseconds per call; torch {torch.__version__}, threads {torch.get_num_threads()}; C GEMV: "
        f"{'built' if has_gemv else 'no compiler'}; CPU flags: {' '.join(cpu_flags()) or 'none of the listed'}"
    )


if __name__ == "__main__":
    main()
