"""A Linear whose weight stays block-scaled FP8 in memory (DeepSeek-V3 checkpoint format,
kernels/fp8.py): `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32, the real weight
being W[n, k] = weight[n, k] * scale_inv[n // block_n, k // block_k]. Forward goes through
`kernels.dispatch.fp8_linear` (W8A8 Triton on CUDA, tile-at-a-time W8A16 torch reference
elsewhere); the weight is never dequantized whole.

A merged Linear (gate_up_proj = [gate; up], qkv_proj) is loaded from separately quantized
checkpoint tensors, so its scale rows are each part's blocks one after the other:
weight_scale_inv [sum_p ceil(N_p / block_n), ceil(K / block_k)]. When every part but the last
is a multiple of block_n this is exactly the blocking of the merged [N, K] matrix and forward is
one call; otherwise each part is its own call.

The loader (loader/fp8_checkpoint.py) swaps these in for nn.Linear modules on the meta device,
before the weights are materialized; model code is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moemesh.kernels.dispatch import fp8_linear
from moemesh.kernels.fp8 import FP8_DTYPE, cdiv


class Fp8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],  # rows of each separately quantized part; one part for a plain Linear
        block: tuple[int, int],  # (block_n, block_k) of weight_scale_inv
        bias: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, sum(output_sizes)
        self.output_sizes, self.block = tuple(int(n) for n in output_sizes), (int(block[0]), int(block[1]))
        block_n, block_k = self.block
        self.scale_rows = tuple(cdiv(n, block_n) for n in self.output_sizes)  # scale rows per part
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )  # [N, K] e4m3fn
        self.weight_scale_inv = nn.Parameter(
            torch.empty(sum(self.scale_rows), cdiv(in_features, block_k), dtype=torch.float32), requires_grad=False
        )  # [sum_p ceil(N_p / block_n), ceil(K / block_k)]
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.single_call = all(n % block_n == 0 for n in self.output_sizes[:-1])

    @classmethod
    def like(cls, linear: nn.Linear, output_sizes: Sequence[int], block: tuple[int, int]) -> Fp8Linear:
        """An FP8 module of the same shape (built on the current default device, e.g. meta)."""
        assert sum(output_sizes) == linear.out_features, (output_sizes, linear.out_features)
        return cls(linear.in_features, output_sizes, block, bias=linear.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if self.single_call:
            y = fp8_linear(x, self.weight, self.weight_scale_inv, self.block)
        else:
            parts, row, scale_row = [], 0, 0
            for rows, scale_rows in zip(self.output_sizes, self.scale_rows):
                weight = self.weight[row : row + rows]  # [N_p, K]
                scale_inv = self.weight_scale_inv[scale_row : scale_row + scale_rows]  # [ceil(N_p / bn), kb]
                parts.append(fp8_linear(x, weight, scale_inv, self.block))
                row, scale_row = row + rows, scale_row + scale_rows
            y = torch.cat(parts, dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, output_sizes={self.output_sizes}, block={self.block}"
