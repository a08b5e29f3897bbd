"""How many parameters and bytes a checkpoint stores per tensor class, from config.json and, when
there is one, `model.safetensors.index.json` (names only; no weights are read). Torch-free.

Bytes per tensor:
- a plain checkpoint: numel * itemsize of its dtype (`torch_dtype`, or `dtype` in transformers 5);
- an FP8 block-quantized one (`quantization_config.quant_method == "fp8"` with
  `weight_block_size` [bm, bn], DeepSeek-V3's release): each quantized linear [out, in] stores
  1 byte per weight plus a float32 `weight_scale_inv` [ceil(out / bm), ceil(in / bn)];
  everything else stays in the checkpoint dtype, except DeepSeek-V3's
  `e_score_correction_bias`, which that release stores in float32. Without an index the
  quantized linears are those `checkpoint_tensors` marks `quantizable`; with one, exactly the
  weights that have a `weight_scale_inv` entry;
- `weight_dtype` given (e.g. "bfloat16", how the engine holds weights today): numel * its
  itemsize for every tensor, no scales (dequantized).

With an index, what is counted is its `weight_map`: each name's shape comes from the config
(names the config does not explain are reported, not guessed) and the sum is compared with
`metadata.total_size`. Parameter counts are weight elements only (scales excluded).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from moemesh.planning.checkpoint_tensors import TENSOR_CLASSES, CheckpointLayout, ModelConfigError, TensorSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_FLOAT32_IN_FP8_RELEASE = ".e_score_correction_bias"
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")
_SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Count:
    params: int = 0
    bytes: int = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.params + other.params, self.bytes + other.bytes)


@dataclass(frozen=True)
class WeightTotals:
    """One Count per tensor class (see checkpoint_tensors)."""

    embedding: Count = Count()
    attention: Count = Count()
    dense_mlp: Count = Count()
    shared_experts: Count = Count()
    router: Count = Count()
    norm: Count = Count()
    routed_experts: Count = Count()
    other: Count = Count()

    @property
    def non_expert(self) -> Count:
        """Everything but the routed experts: what an attention (prefill/decode) pod holds."""
        total = Count()
        for name in TENSOR_CLASSES:
            if name != "routed_experts":
                total += getattr(self, name)
        return total

    @property
    def total(self) -> Count:
        return self.non_expert + self.routed_experts


class _Tally:
    """Adds Counts per (mtp, tensor class) in plain integers; `totals` freezes them."""

    def __init__(self):
        self.sums = {(mtp, c): [0, 0] for mtp in (False, True) for c in TENSOR_CLASSES}

    def add(self, spec: TensorSpec, count: Count) -> None:
        entry = self.sums[(spec.mtp, spec.tensor_class)]
        entry[0] += count.params
        entry[1] += count.bytes

    def totals(self, mtp: bool) -> WeightTotals:
        return WeightTotals(**{c: Count(*self.sums[(mtp, c)]) for c in TENSOR_CLASSES})


@dataclass(frozen=True)
class IndexCheck:
    """How `model.safetensors.index.json` compares with what config.json implies."""

    num_tensors: int
    total_size: int | None  # metadata.total_size, when the index has it
    counted_bytes: int  # the sum over the names this module could size
    unknown_names: tuple[str, ...]  # names the config does not explain (first few)
    num_unknown: int
    num_missing: int  # tensors the config implies that the index lacks
    mtp_stored: bool  # the index holds the MTP layers the config names (transformers' own saves do not)

    @property
    def unaccounted_bytes(self) -> int | None:
        return None if self.total_size is None else self.total_size - self.counted_bytes


@dataclass(frozen=True)
class WeightFormat:
    dtype: str  # checkpoint dtype of unquantized tensors (or the forced weight_dtype)
    fp8_block: tuple[int, int] | None  # FP8 block quantization, None when not quantized
    forced: bool = False  # weight_dtype given: every tensor at `dtype`, no scales

    def describe(self) -> str:
        if self.fp8_block is None:
            return self.dtype + (" (dequantized)" if self.forced else "")
        return f"fp8 with float32 scales per {self.fp8_block[0]}x{self.fp8_block[1]} block ({self.dtype} elsewhere)"


def weight_format(config: dict, weight_dtype: str | None = None) -> WeightFormat:
    if weight_dtype is not None:
        if weight_dtype not in DTYPE_BYTES:
            raise ModelConfigError(f"weight dtype must be one of {sorted(DTYPE_BYTES)}, got {weight_dtype!r}")
        return WeightFormat(weight_dtype, None, forced=True)
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise ModelConfigError(f"config.json dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    quant = config.get("quantization_config")
    if not quant:
        return WeightFormat(dtype, None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if method != "fp8":
        raise ModelConfigError(
            f"quantization {method!r} is not supported (only block-quantized fp8); "
            "give a weight dtype to size the dequantized weights"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelConfigError(f"fp8 quantization_config.weight_block_size must be [rows, cols], got {block!r}")
    return WeightFormat(dtype, (block[0], block[1]))


def scale_bytes(shape: tuple[int, ...], block: tuple[int, int]) -> int:
    """Bytes of the float32 weight_scale_inv of a quantized weight [..., out, in]."""
    *lead, rows, cols = shape
    return 4 * math.prod(lead) * math.ceil(rows / block[0]) * math.ceil(cols / block[1])


def tensor_count(spec: TensorSpec, fmt: WeightFormat, quantized: bool) -> Count:
    """The weight itself (a quantized one: its FP8 bytes only; scales are counted apart)."""
    if fmt.forced:
        return Count(spec.numel, spec.numel * DTYPE_BYTES[fmt.dtype])
    if quantized:
        return Count(spec.numel, spec.numel)
    if fmt.fp8_block is not None and spec.name.endswith(_FLOAT32_IN_FP8_RELEASE):
        return Count(spec.numel, 4 * spec.numel)
    return Count(spec.numel, spec.numel * DTYPE_BYTES[fmt.dtype])


def count_from_config(layout: CheckpointLayout, fmt: WeightFormat) -> tuple[WeightTotals, WeightTotals]:
    """(main, mtp) totals of the tensors config.json implies."""
    tally = _Tally()
    for spec in layout.tensors:
        quantized = fmt.fp8_block is not None and spec.quantizable
        count = tensor_count(spec, fmt, quantized)
        if fmt.fp8_block is not None and spec.quantizable:
            count += Count(0, scale_bytes(spec.shape, fmt.fp8_block))
        tally.add(spec, count)
    return tally.totals(False), tally.totals(True)


def count_from_index(
    layout: CheckpointLayout, fmt: WeightFormat, weight_map: dict[str, str], total_size: int | None
) -> tuple[WeightTotals, WeightTotals, IndexCheck]:
    """(main, mtp, check) totals of the tensors the index names."""
    specs = {s.name: s for s in (*layout.tensors, *layout.fused_alternatives)}
    tally = _Tally()
    counted, unknown = 0, []
    for name in weight_map:
        if name in specs:
            spec = specs[name]
            quantized = not fmt.forced and name + _SCALE_SUFFIX in weight_map
            count = tensor_count(spec, fmt, quantized)
        elif name.endswith(_SCALE_SUFFIX) and name[: -len(_SCALE_SUFFIX)] in specs:
            spec = specs[name[: -len(_SCALE_SUFFIX)]]
            if fmt.forced:
                continue  # dequantized: no scales held
            count = Count(0, scale_bytes(spec.shape, fmt.fp8_block or (128, 128)))
        else:
            unknown.append(name)
            continue
        tally.add(spec, count)
        counted += count.bytes
    fused_present = {s.name.rsplit(".", 1)[0] for s in layout.fused_alternatives if s.name in weight_map}
    mtp_stored = any(s.mtp and s.name in weight_map for s in (*layout.tensors, *layout.fused_alternatives))
    missing = 0
    for spec in layout.tensors:
        if spec.name in weight_map or (spec.mtp and not mtp_stored):
            continue
        m = _PER_EXPERT.match(spec.name)
        if m is None or m.group(1) not in fused_present:
            missing += 1
    check = IndexCheck(
        len(weight_map), total_size, counted, tuple(sorted(unknown)[:5]), len(unknown), missing, mtp_stored
    )
    return tally.totals(False), tally.totals(True), check
