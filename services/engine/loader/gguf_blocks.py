"""GGUF block formats -> one exact group-quantized form, without dequantizing.

Every supported type is, per row of the weight, groups of `group_size` consecutive columns with
w = scale[g] * q + min[g] (`min` absent for the symmetric types):

| type | group | codes q            | scale       | min         | llama.cpp block                   |
| ---- | ----- | ------------------ | ----------- | ----------- | --------------------------------- |
| Q8_0 | 32    | int8               | d           | -           | d fp16, 32 x int8                 |
| Q4_0 | 32    | uint4 0..15        | d           | -8 d        | d fp16, 32 x 4 bit, w = d (q - 8) |
| Q4_1 | 32    | uint4 0..15        | d           | m           | d, m fp16, 32 x 4 bit             |
| Q4_K | 32    | uint4 0..15        | d sc_j      | -dmin m_j   | 256: d, dmin fp16, 8 x 6-bit sc/m |
| Q6_K | 16    | int8 -32..31       | d sc_j      | -           | 256: d fp16, 16 x int8 sc, 6 bit  |

The K-quants map exactly: a 6-bit (Q4_K) or int8 (Q6_K) sub-scale times an fp16 super-scale has
at most 18 significant bits, so d * sc_j (and dmin * m_j) is exact in float32, and so is
scale * q (at most 23 bits); `gguf.quants.dequantize` rounds once, in `scale * q + min`, as we
do. Scales and mins are float32 here; the layer keeps them in float16 when that is exact
(Q8_0, Q4_0, Q4_1) and float32 otherwise (the K-quants' d * sc_j usually needs > 11 bits).
"""

from __future__ import annotations

import numpy as np
import torch

from moemesh.engine.layers.group_quantized import GroupQuantized

QUANTIZED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
_SUPER = 256  # K-quant super-block


def read_blocks(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> GroupQuantized:
    """`data`: a GGUF tensor's bytes, uint8 [N, bytes per row]; `shape`: (N, K) as PyTorch sees it."""
    n, k = shape
    blocks = np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[qtype])
    codes, scale, minimum, bits, group = _READERS[qtype](blocks)
    num_groups = k // group
    tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return GroupQuantized(
        codes=tensor(codes.reshape(n, k)),
        bits=bits,
        group_size=group,
        scale=tensor(scale.astype(np.float32).reshape(n, num_groups)),
        min=None if minimum is None else tensor(minimum.astype(np.float32).reshape(n, num_groups)),
        qtype=qtype,
    )


def _f16(b: np.ndarray) -> np.ndarray:  # [num_blocks, 2] bytes -> [num_blocks, 1] float32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[..., width] bytes -> [..., 2 * width]: the low nibbles, then the high ones (ggml order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 8, 32


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, -8 * d, 4, 32


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 4, 32


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    packed = b[:, 4:16].reshape(n, 3, 4)  # 6-bit scale/min pairs of 8 sub-blocks, ggml's get_scale_min
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [n, 8]
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    qs = b[:, 16:].reshape(n, 4, 32)  # four chunks: low nibbles = sub-block 2c, high = 2c + 1
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, _SUPER)
    return codes, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 4, 32


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210])
    low = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 4, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(n, 2, 4, 32)
    codes = ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(n, _SUPER)
    return codes, d * sc, None, 8, 16


_READERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
