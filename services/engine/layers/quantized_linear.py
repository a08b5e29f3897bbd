"""Weight-only quantized Linear and Embedding: GGUF weights stay in their block form in memory.

The loader (loader/gguf_quant.py) hands each module a `GroupQuantized` weight (codes with a scale
and min per group of columns, loader/gguf_blocks.py) and the activation dtype; `load` picks one of
four storage forms, and with it the kernel:

- `int4pack` (4-bit codes, groups of 32..256, bfloat16 on a CPU without AVX512-BF16): PyTorch's
  `_weight_int4pack_mm_for_cpu`, which computes w = (q - 8) * scale + zero per group. With GGUF's
  w = scale * q + min that is zero = min + 8 * scale; the pair is stored in bfloat16, the only
  dtype whose x86 kernel is vectorized (float32 runs a scalar loop), so scales are rounded to bf16.
  It beats the C GEMV below on every SmolLM2 shape at M = 1, but its cost grows with every row
  (SmolLM2's gate_up at M = 64, one thread: 2.7 ms), so a round of more than `GEMV_MAX_M` rows
  rebuilds W^T from the int4pack layout in C (kernels.int4pack_dequantize, 0.18
  ms) and multiplies densely in bf16 (1.2 ms). That needs N to be a multiple of the layout's row
  blocks (`block_n`: 64 with AVX-512, 32 with AVX2); other weights run int4pack at every M.
- `blocks` (4- and 8-bit codes, N a multiple of the C kernels' row block: 64 with AVX-512, 32
  with AVX2; float32 activations, and bfloat16 ones where AVX512-BF16 gives the GEMM bfloat16 dot
  products and there is no AMX, `bf16_code_blocks`: SmolLM2's projections at 64 rows 1.1x
  int4pack's rebuild + oneDNN at one thread, 1.5x at two): the codes in row blocks
  (kernels/csrc/code_blocks.h; 4-bit ones in int4pack's code order), exact float16 / float32 scales
  and mins [G, N]. At most `BLOCKS_GEMV_MAX_M` rows run the blocks' C GEMV (SmolLM2's projections
  at one row: 1.5x GGUF's own order), more the blocks' C GEMM, which rebuilds each block's W^T a
  slice at a time in cache and multiplies it there (at 64 rows 1.4x a rebuilt weight through MKL,
  1.6x at two threads); an embedding gathers its rows. The same values as `int8` / `nibbles`.
- `int8` (8-bit codes otherwise: Q8_0, Q6_K): codes [N, K] int8, scales [N, G].
- `nibbles` (4-bit codes otherwise: bfloat16 gathered embeddings, shapes the blocks do not fit,
  CPUs without AVX2): two codes per byte in kernels/csrc/group_gemv.c's order (GGUF's own), scales and
  mins [N, G].

`int8` and `nibbles` multiply a round of at most `GEMV_MAX_M` rows with the C kernel
(kernels.quantized_gemv: exact scales, float32 sums, the weight read once at memory bandwidth) and
dequantize per call above that. "Dequantize per call" rebuilds the weight (whole, or a weight of
more than `CHUNK_ROWS` rows in chunks of `CHUNK_BYTES`) from the exact scales (float16 where that
is exact, float32 otherwise): code * scale + min
rounded once to float32, then once to the activation dtype, by the C kernel (`dequantize`), or by
torch where no C compiler built it (logged once; the same values); then multiplies. In float32 it
is exactly `gguf.quants.dequantize(...)`. No full-precision copy of a weight outlives a call.

`QuantizedEmbedding` gathers rows of codes and dequantizes only those; a tied lm_head is the same
module's `linear`.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F
from torch import nn

from moemesh import kernels
from moemesh.engine import dtype as engine_dtype
from moemesh.engine.layers.group_quantized import GroupQuantized

log = logging.getLogger(__name__)

INT4PACK_GROUPS = (32, 64, 128, 256)  # group sizes _weight_int4pack_mm_for_cpu takes
GEMV_MAX_M = 8  # above this many rows, dequantize + dense beats the C GEMV (it re-reads the weight per 8 rows)
# code blocks: the GEMV up to this many rows, the blocks' GEMM above (SmolLM2's gate_up, one
# thread: 1 row 0.10 against 0.15 ms, 2 rows even, 4 rows 0.35 against 0.28, 8 rows 0.61 against 0.39)
BLOCKS_GEMV_MAX_M = 2
CHUNK_ROWS = 8192  # weights with more rows than this (an lm_head) are dequantized and multiplied in chunks
# of this many bytes: one chunk stays in cache between its dequantization and its matmul (SmolLM2's
# 49152 x 576 lm_head at M = 64, float32, one thread: 8192-row chunks 64 ms, 2048-row chunks 45 ms)
CHUNK_BYTES = 4 << 20
_logged: set[tuple[str, str, str]] = set()


def bf16_code_blocks() -> bool:
    """Whether bfloat16 activations get code blocks on this CPU: where their GEMM has bfloat16 dot
    products (AVX512-BF16, 64-row blocks), but not with AMX, whose tile GEMM (oneDNN's, on
    int4pack's rebuilt weight) outruns vector dot products."""
    return kernels.blocks_block_n() == 64 and kernels.blocks_bf16_gemm() and "amx_bf16" not in engine_dtype.cpu_flags()


def choose_form(weight: GroupQuantized, dtype: torch.dtype, device: str, gather: bool) -> str:
    """The storage form for `weight` run with `dtype` activations; `gather`: rows are also read
    one by one (an embedding), which the int4pack layout cannot do."""
    cpu = torch.device(device).type == "cpu"
    blocks = cpu and (dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_code_blocks()))
    block_n = kernels.blocks_block_n() if blocks else None
    if block_n and weight.shape[0] % block_n == 0 and weight.group_size <= 256:
        return "blocks"
    if weight.bits == 4 and cpu and dtype == torch.bfloat16 and not gather and weight.group_size in INT4PACK_GROUPS:
        return "int4pack"
    form = "int8" if weight.bits == 8 else "nibbles"
    if form == "nibbles" and weight.group_size % 32:
        raise ValueError(f"{weight.qtype}: 4-bit codes in groups of {weight.group_size} (a multiple of 32 is needed)")
    if not cpu or not kernels.quantized_kernels_built():
        _log_once(weight.qtype, dtype, f"{form}: no C GEMV for {device}; dequantizing per call")
    return form


def _exact_pair(scale: torch.Tensor, minimum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Both float16 when both survive the round trip (GGUF's own d and m do), else both float32
    (the C kernel reads one dtype)."""
    if all(t is None or torch.equal(t.half().float(), t) for t in (scale, minimum)):
        return scale.half(), None if minimum is None else minimum.half()
    return scale.float(), None if minimum is None else minimum.float()


def _log_once(qtype: str, dtype: torch.dtype, what: str) -> None:
    key = (qtype, str(dtype), what)
    if key not in _logged:
        _logged.add(key)
        log.info("%s weights with %s activations -> %s", qtype, str(dtype).removeprefix("torch."), what)


class QuantizedLinear(nn.Module):
    keeps_storage_dtypes = True  # loader's cast_floating leaves these buffers as they are

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.form, self.qtype, self.group_size, self.bits = "", "", 0, 0  # set by load()
        self.block_n: int | None = None  # int4pack (if the C kernel reads it) and blocks: the layout's row blocks

    @classmethod
    def like(cls, linear: nn.Linear) -> QuantizedLinear:
        assert linear.bias is None, "GGUF Llama projections have no bias"
        return cls(linear.in_features, linear.out_features)

    def load(self, weight: GroupQuantized, dtype: torch.dtype, device: str = "cpu", gather: bool = False) -> None:
        n, k = weight.shape
        if (n, k) != (self.out_features, self.in_features) or k % weight.group_size:
            raise ValueError(
                f"{weight.qtype} weight {(n, k)} does not fit a [{self.out_features}, "
                f"{self.in_features}] projection in groups of {weight.group_size}"
            )
        self.form, self.qtype, self.group_size, self.bits = (
            choose_form(weight, dtype, device, gather),
            weight.qtype,
            weight.group_size,
            weight.bits,
        )
        if self.form == "int4pack":
            minimum = weight.min if weight.min is not None else torch.zeros_like(weight.scale)
            zero = minimum + 8 * weight.scale  # (q - 8) * scale + zero == scale * q + min
            scales_zeros = torch.stack((weight.scale, zero), dim=-1).transpose(0, 1)  # [G, N, 2]
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.int(), 1))
            self.register_buffer("scales_zeros", scales_zeros.to(dtype).contiguous())
            block_n = kernels.int4pack_block_n()
            self.block_n = block_n if block_n and n % block_n == 0 else None  # None: int4pack at every M
            if self.block_n is None:
                _log_once(weight.qtype, dtype, f"int4pack at every row count ({n} rows, layout blocks {block_n})")
        elif self.form == "blocks":
            self.block_n = kernels.blocks_block_n()
            _log_once(
                weight.qtype,
                dtype,
                f"code blocks of {self.block_n} rows (the C GEMV up to {BLOCKS_GEMV_MAX_M} rows, the C GEMM above)",
            )
            scales, mins = _exact_pair(weight.scale, weight.min)
            self.register_buffer("codes", kernels.blocks_from_codes(weight.codes, self.block_n, weight.bits))
            self.register_buffer("scales", scales.t().contiguous())  # [G, N]
            if mins is not None:
                self.register_buffer("mins", mins.t().contiguous())  # [G, N]
        else:
            if self.form == "int8" and weight.min is not None:
                raise ValueError(f"{weight.qtype}: 8-bit codes with a min are not supported")
            codes = weight.codes if self.form == "int8" else kernels.nibbles_from_codes(weight.codes)
            scales, mins = _exact_pair(weight.scale, weight.min)
            self.register_buffer("codes", codes.contiguous())  # [N, K] int8 or [N, K / 2] uint8
            self.register_buffer("scales", scales.contiguous())  # [N, G]
            if mins is not None:
                self.register_buffer("mins", mins.contiguous())  # [N, G]
        self.to(device)

    # -- compute ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.form == "int4pack" and (x2.shape[0] <= GEMV_MAX_M or self.block_n is None):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.packed, self.group_size, self.scales_zeros
            )
        elif self.form == "int4pack":
            y = self._int4pack_dequantized_matmul(x2)
        elif self.form == "blocks":
            multiply = kernels.blocks_gemv if x2.shape[0] <= BLOCKS_GEMV_MAX_M else kernels.blocks_gemm
            y = multiply(x2, self.codes, self.scales, getattr(self, "mins", None), self.block_n).to(x2.dtype)
        elif x2.shape[0] <= GEMV_MAX_M and not x2.is_cuda and kernels.quantized_kernels_built():
            y = kernels.quantized_gemv(x2, self.codes, self.scales, getattr(self, "mins", None)).to(x2.dtype)
        else:
            y = self._dequantized_matmul(x2)
        return y.view(*lead, self.out_features)

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        n = self.out_features
        chunk = n if n <= CHUNK_ROWS else max(256, CHUNK_BYTES // (self.in_features * x.element_size()))
        buffer = _scratch(chunk * self.in_features, x.dtype).view(chunk, self.in_features)
        if n <= chunk:
            return F.linear(x, self.dequantize_rows(slice(None), x.dtype, out=buffer))
        y = x.new_empty(x.shape[0], n)  # [M, N]
        for r in range(0, n, chunk):
            rows = slice(r, min(r + chunk, n))
            y[:, rows] = F.linear(x, self.dequantize_rows(rows, x.dtype, out=buffer[: rows.stop - rows.start]))
        return y

    def _int4pack_dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bfloat16 -> [M, N]
        """x @ W^T with W^T rebuilt by the C kernel from the int4pack layout, CHUNK_ROWS columns at a time."""
        n, k = self.out_features, self.in_features
        chunk = min(n, CHUNK_ROWS)
        buffer = _scratch(chunk * k, torch.bfloat16)
        y = x.new_empty(x.shape[0], n) if n > chunk else None  # [M, N]
        for r in range(0, n, chunk):
            cols = slice(r, min(r + chunk, n))
            width = cols.stop - cols.start
            w_t = kernels.int4pack_dequantize(
                self.packed,
                self.scales_zeros,
                self.group_size,
                self.block_n,
                cols,
                out=buffer[: k * width].view(k, width),
            )
            if y is None:
                return torch.mm(x, w_t)
            y[:, cols] = torch.mm(x, w_t)
        return y

    def dequantize_rows(
        self, rows: slice | torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [R, K]
        """Rows of the real weight (all with `slice(None)`), in one pass: codes times scale (plus
        min) computed in float32, where it is exact (8-bit codes times a float16 scale, 6-bit
        times d * sc, 4-bit plus a float16 min fit its 24 bits), and rounded once to `dtype` as
        it is stored (into `out`, [R, K], if given)."""
        if self.form == "int4pack":
            raise RuntimeError("int4pack weights are only multiplied; gathered weights use another form")
        if self.form == "blocks":
            mins = getattr(self, "mins", None)
            if dtype == torch.float32:
                return kernels.blocks_gather(self.codes, self.scales, mins, self.block_n, rows, out)
            w = kernels.blocks_gather(self.codes, self.scales, mins, self.block_n, rows)
            return w.to(dtype) if out is None else out.copy_(w)
        if dtype in (torch.float32, torch.bfloat16) and not self.codes.is_cuda and kernels.quantized_kernels_built():
            return kernels.group_dequantize(self.codes, self.scales, getattr(self, "mins", None), dtype, rows, out)
        return self._dequantize_rows_torch(rows, dtype, out)

    def _dequantize_rows_torch(
        self, rows: slice | torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [R, K]: dequantize_rows without the C kernel (the same values)
        blocks = self.form == "blocks"  # codes in row blocks, scales [G, N]
        codes = kernels.codes_from_blocks(self.codes, self.block_n)[rows] if blocks else self.codes[rows]
        if self.form == "nibbles":
            codes = kernels.codes_from_nibbles(codes)
        r = codes.shape[0]
        codes = codes.view(r, -1, self.group_size)  # [R, G, group]
        w = torch.empty(codes.shape, dtype=dtype) if out is None else out.view(codes.shape)
        scales = (self.scales.t() if blocks else self.scales)[rows].float()[..., None]  # [R, G, 1]
        if hasattr(self, "mins"):
            mins = self.mins.t() if blocks else self.mins
            torch.addcmul(mins[rows].float()[..., None], codes, scales, out=w)
        else:
            torch.mul(codes, scales, out=w)
        return w.view(r, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype} as {self.form}"


_local = threading.local()  # per thread: an engine runs one forward at a time on its thread


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused flat buffer for a dequantized weight or chunk."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: written inside and outside inference mode
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
