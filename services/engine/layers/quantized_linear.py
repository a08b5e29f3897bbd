"""Weight-only quantized Linear and Embedding: GGUF weights stay in their block form in memory.

The loader (loader/gguf_quant.py) hands each module a `GroupQuantized` weight (codes with a scale
and min per group of columns, loader/gguf_blocks.py) and the activation dtype; `load` picks one of
three storage forms, and with it the kernel:

- `int4pack` (4-bit codes, groups of 32..256, bfloat16 on CPU): PyTorch's
  `_weight_int4pack_mm_for_cpu`, which computes w = (q - 8) * scale + zero per group. With GGUF's
  w = scale * q + min that is zero = min + 8 * scale; the pair is stored in bfloat16, the only
  dtype whose x86 kernel is vectorized (float32 runs a scalar loop), so scales are rounded to bf16.
- `int8` (8-bit codes: Q8_0, Q6_K): codes [G, N, group] int8 and scales [G, N]. In bfloat16 on CPU,
  a round of at most `INT8_GROUPS_MAX_M` tokens sums `_weight_int8pack_mm` over the column groups
  (its scale is per output row, so each group is one call); larger rounds dequantize.
- `nibbles` (4-bit codes otherwise): two codes per byte, scale/min [N, G]; dequantizes per call.

"Dequantize per call" rebuilds the weight, `CHUNK_ROWS` rows at a time, in float32 from the
exact scales (float16 where that is exact, float32 otherwise), casts it to the activation dtype
and multiplies: in float32 it is exactly `gguf.quants.dequantize(...)`, at the cost of
rebuilding the matrix for every call (float32 has no vectorized quantized kernel on x86). No
full-precision copy of a weight outlives a call.

`QuantizedEmbedding` gathers rows of codes and dequantizes only those; a tied lm_head is the same
module's `linear`.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.engine.layers.group_quantized import GroupQuantized

log = logging.getLogger(__name__)

INT4PACK_GROUPS = (32, 64, 128, 256)  # group sizes _weight_int4pack_mm_for_cpu takes
INT8_GROUPS_MAX_M = 8  # above this many rows, dequantize + dense beats one int8 call per group
CHUNK_ROWS = 8192  # rows dequantized at once (bounds the transient copy of a large weight)
_logged: set[tuple[str, str, str]] = set()


def choose_form(weight: GroupQuantized, dtype: torch.dtype, device: str, gather: bool) -> str:
    """The storage form for `weight` run with `dtype` activations; `gather`: rows are also read
    one by one (an embedding), which the int4pack layout cannot do."""
    fast = torch.device(device).type == "cpu" and dtype == torch.bfloat16
    if weight.bits == 8:
        form = "int8"
        if not fast:
            _log_once(weight.qtype, dtype, "int8: no vectorized PyTorch kernel for this dtype; dequantizing per call")
        return form
    if fast and not gather and weight.group_size in INT4PACK_GROUPS:
        return "int4pack"
    reason = "rows are gathered (embedding)" if gather else f"no vectorized int4 kernel for {dtype} on {device}"
    _log_once(weight.qtype, dtype, f"nibbles: {reason}; dequantizing per call")
    return "nibbles"


def _log_once(qtype: str, dtype: torch.dtype, what: str) -> None:
    key = (qtype, str(dtype), what)
    if key not in _logged:
        _logged.add(key)
        log.info("%s weights with %s activations -> %s", qtype, str(dtype).removeprefix("torch."), what)


def _exact(t: torch.Tensor) -> torch.Tensor:
    """float16 when every value survives the round trip (GGUF's own d and m do), else float32."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t


class QuantizedLinear(nn.Module):
    keeps_storage_dtypes = True  # loader's cast_floating leaves these buffers as they are

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.form, self.qtype, self.group_size = "", "", 0  # set by load()

    @classmethod
    def like(cls, linear: nn.Linear) -> QuantizedLinear:
        assert linear.bias is None, "GGUF Llama projections have no bias"
        return cls(linear.in_features, linear.out_features)

    def load(self, weight: GroupQuantized, dtype: torch.dtype, device: str = "cpu", gather: bool = False) -> None:
        n, k = weight.shape
        if (n, k) != (self.out_features, self.in_features) or k % weight.group_size:
            raise ValueError(f"{weight.qtype} weight {(n, k)} does not fit a [{self.out_features}, "
                             f"{self.in_features}] projection in groups of {weight.group_size}")  # fmt: skip
        self.form, self.qtype, self.group_size = (
            choose_form(weight, dtype, device, gather),
            weight.qtype,
            weight.group_size,
        )
        num_groups = k // weight.group_size
        if self.form == "int4pack":
            minimum = weight.min if weight.min is not None else torch.zeros_like(weight.scale)
            zero = minimum + 8 * weight.scale  # (q - 8) * scale + zero == scale * q + min
            scales_zeros = torch.stack((weight.scale, zero), dim=-1).transpose(0, 1)  # [G, N, 2]
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.int(), 1))
            self.register_buffer("scales_zeros", scales_zeros.to(dtype).contiguous())
        elif self.form == "int8":
            codes = weight.codes.view(n, num_groups, weight.group_size).transpose(0, 1)  # [G, N, group]
            scales = weight.scale.T  # [G, N]
            if weight.min is not None:
                raise ValueError(f"{weight.qtype}: 8-bit codes with a min are not supported")
            self.register_buffer("codes", codes.contiguous())
            self.register_buffer(
                "scales", (scales.to(dtype) if dtype == torch.bfloat16 else _exact(scales)).contiguous()
            )
        else:
            codes = weight.codes
            self.register_buffer("codes", (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous())  # [N, K / 2]
            self.register_buffer("scales", _exact(weight.scale).T.contiguous())  # [G, N]
            if weight.min is not None:
                self.register_buffer("mins", _exact(weight.min).T.contiguous())  # [G, N]
        self.to(device)

    # -- compute ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.form == "int4pack":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group_size,
                                                           self.scales_zeros)  # fmt: skip
        elif (
            self.form == "int8" and self.scales.dtype == x2.dtype == torch.bfloat16 and x2.shape[0] <= INT8_GROUPS_MAX_M
        ):
            y = self._int8_groups(x2)
        else:
            y = self._dequantized_matmul(x2)
        return y.view(*lead, self.out_features)

    def _int8_groups(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        num_groups = self.codes.shape[0]
        xg = x.view(-1, num_groups, self.group_size).transpose(0, 1).contiguous()  # [G, M, group]
        y = torch.ops.aten._weight_int8pack_mm(xg[0], self.codes[0], self.scales[0]).float()
        for g in range(1, num_groups):
            y += torch.ops.aten._weight_int8pack_mm(xg[g], self.codes[g], self.scales[g])
        return y.to(x.dtype)

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        n = self.out_features
        if self.form == "int8":  # one pass per chunk into a reused buffer: codes * scale in x's dtype
            y = x.new_empty(x.shape[0], n)  # [M, N]
            for r in range(0, n, CHUNK_ROWS):
                rows = slice(r, min(r + CHUNK_ROWS, n))
                y[:, rows] = F.linear(x, self._int8_rows(rows, x.dtype))
            return y
        if n <= CHUNK_ROWS:
            return F.linear(x, self.dequantize_rows(slice(None), x.dtype))
        parts = [F.linear(x, self.dequantize_rows(slice(r, r + CHUNK_ROWS), x.dtype)) for r in range(0, n, CHUNK_ROWS)]
        return torch.cat(parts, dim=-1)

    def _int8_rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:  # [R, K] in a scratch buffer
        """codes * scale for a slice of rows, in one pass. Exact in float32 (8-bit codes times a
        float16 scale, or 6-bit times d * sc, fit its 24 bits); in bfloat16 the exact product is
        rounded once, as a float32 dequantization cast to bf16 would be."""
        codes = self.codes[:, rows].transpose(0, 1)  # [R, G, group] int8
        scales = self.scales[:, rows].T.to(dtype)[..., None]  # [R, G, 1]
        out = _scratch(codes.shape[0] * self.in_features, dtype).view(codes.shape)
        torch.mul(codes, scales, out=out)
        return out.view(-1, self.in_features)

    def dequantize_rows(self, rows: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [R, K]
        """Rows of the real weight (all with `slice(None)`), computed in float32 then cast."""
        if self.form == "int4pack":
            raise RuntimeError("int4pack weights are only multiplied; gathered weights use another form")
        scales = self.scales[:, rows].T.float()  # [R, G]
        if self.form == "int8":
            codes = self.codes[:, rows].transpose(0, 1)  # [R, G, group]
        else:
            packed = self.codes[rows]  # [R, K / 2]
            codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [R, K / 2, 2]
            codes = codes.view(packed.shape[0], -1, self.group_size)  # [R, G, group]
        w = codes.float() * scales[..., None]
        if hasattr(self, "mins"):
            w += self.mins[:, rows].T.float()[..., None]
        return w.reshape(-1, self.in_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype} as {self.form}"


_local = threading.local()  # per thread: an engine runs one forward at a time on its thread


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused flat buffer for a dequantized chunk (at most CHUNK_ROWS x K)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


class QuantizedEmbedding(nn.Module):
    """Token embedding over a quantized table: gathers and dequantizes only the rows asked for."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.table = QuantizedLinear(embedding_dim, num_embeddings)  # rows = tokens
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        return self.table.dequantize_rows(input_ids, self.dtype)

    def linear(self, hidden_states: torch.Tensor) -> torch.Tensor:  # tied lm_head: [M, hidden] -> [M, vocab]
        return self.table(hidden_states)
