"""A weight as group-quantized codes: per row, groups of `group_size` columns with
w = scale[g] * q + min[g]. What the GGUF loader produces (loader/gguf_blocks.py) and the quantized
layers store (layers/quantized_linear.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupQuantized:
    """A [N, K] weight as codes plus per-(row, group) scale and min: w = scale * q + min."""

    codes: torch.Tensor  # [N, K] uint8 (4-bit types, 0..15) or int8 (8-bit and Q6_K)
    bits: int  # 4: codes fit a nibble; 8: one byte per code
    group_size: int
    scale: torch.Tensor  # [N, K // group_size] float32
    min: torch.Tensor | None  # [N, K // group_size] float32; None: w = scale * q
    qtype: str  # the GGUF type it came from (log lines, errors)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def rows(self, index: torch.Tensor) -> GroupQuantized:
        """The same weight with its rows taken in `index` order (llama.cpp's q/k permutation)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return GroupQuantized(
            self.codes[index], self.bits, self.group_size, self.scale[index], pick(self.min), self.qtype
        )

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, the reference form (tests, fallback)
        n, k = self.shape
        w = self.codes.view(n, k // self.group_size, self.group_size).float() * self.scale[..., None]
        if self.min is not None:
            w = w + self.min[..., None]
        return w.view(n, k)


def concat_rows(parts: list[GroupQuantized]) -> GroupQuantized:
    """Merged projections (q/k/v, gate/up) of one type: their rows one after the other."""
    first = parts[0]
    assert all(
        (p.bits, p.group_size, p.qtype, p.min is None) == (first.bits, first.group_size, first.qtype, first.min is None)
        for p in parts
    ), [p.qtype for p in parts]
    mins = None if first.min is None else torch.cat([p.min for p in parts])
    return GroupQuantized(
        torch.cat([p.codes for p in parts]),
        first.bits,
        first.group_size,
        torch.cat([p.scale for p in parts]),
        mins,
        first.qtype,
    )
