"""How many pods a model needs: the memory plan of a mesh, from config.json (and the safetensors
index when there is one), without any weights. Torch-free: the operator calls `plan_mesh` and
`check_expert_pods` to refuse a custom resource whose expert pods cannot hold the experts.

Per pod, `usable = gpu_memory * (1 - reserve_fraction)`. The reserve (default 10%) covers what
the plan does not size: activations of a round, the CUDA context and kernels' workspaces,
communication buffers and allocator fragmentation.

- Expert pods hold routed-expert replicas. A *slot* holds one replica of an expert in every MoE
  layer (the placement gives a worker the same slots in all layers), so it costs
  `slot_bytes = routed-expert bytes / num_experts`. EPLB spreads `num_experts + redundant`
  slots evenly: the minimum pod count is the smallest W that divides the slots with
  `slots / W * slot_bytes <= usable`. While a placement changes, a worker holds the version it
  serves and the one it loads (two stacks), so a rebalance needs the slots to fit twice
  (`min_workers_for_rebalance`).
- Attention pods (prefill / decode workers) hold everything else (embeddings, attention, dense
  and shared FFNs, routers, norms) plus the paged KV cache: per token and layer,
  kv_lora_rank + qk_rope_head_dim values for MLA (DeepSeek-V3's latent cache), else
  2 * num_kv_heads * head_dim (K and V), at the KV dtype.
- DeepSeek-V3's multi-token-prediction layers are stored in the checkpoint but not loaded by the
  engine: they are counted apart (`mtp_weights`) and left out of the plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from moemesh.planning.checkpoint_tensors import ModelConfigError, checkpoint_tensors, field
from moemesh.planning.weight_bytes import (
    DTYPE_BYTES,
    IndexCheck,
    WeightTotals,
    count_from_config,
    count_from_index,
    weight_format,
)

KV_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_RESERVE_FRACTION = 0.1
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


class MemoryPlanError(ValueError):
    """A bad argument of the plan (size, reserve, counts) or an unreadable model file."""


@dataclass(frozen=True)
class ExpertSizing:
    num_slots: int  # per MoE layer: num_experts (+ redundant replicas)
    min_workers: int | None  # None: one slot does not fit on a pod
    slots_per_worker: int | None
    bytes_per_worker: int | None
    min_workers_for_rebalance: int | None  # two placement versions held at once


@dataclass(frozen=True)
class MemoryPlan:
    architecture: str
    weight_format: str
    kv_dtype: str
    num_layers: int
    num_moe_layers: int
    num_experts: int
    num_mtp_layers: int  # stored in the checkpoint (the index decides when there is one)
    weights: WeightTotals  # what the engine loads (MTP layers excluded)
    mtp_weights: WeightTotals  # stored in the checkpoint, not loaded
    index: IndexCheck | None  # None: counted from config.json alone
    kv_layout: str  # "mla_latent" | "full_kv"
    kv_bytes_per_token: int  # all layers
    gpu_memory_bytes: int
    reserve_fraction: float
    usable_bytes_per_pod: int
    slot_bytes: int  # one replica of one expert in every MoE layer (0: dense)
    redundant_experts: int
    one_copy: ExpertSizing | None  # None: dense model
    with_redundancy: ExpertSizing | None
    attention_pod_kv_tokens: int  # KV tokens beside the non-expert weights (0: they do not fit)
    aggregated_pod_kv_tokens: int  # KV tokens beside all weights on one pod (0: they do not fit)
    kv_tokens: int | None  # requested
    expert_pods: int | None  # requested
    expert_pods_problem: str | None  # check_expert_pods(plan, expert_pods)
    notes: tuple[str, ...]


def parse_size(text: str | int) -> int:
    """Bytes from "141GiB", "80GB", "80Gi", "1.5TiB" or plain bytes; SI units are powers of 1000."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = Decimal(text), 1
    else:
        m = _SIZE.match(str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise MemoryPlanError(
                f"cannot read size {text!r}: use bytes or a number with B, KB, MB, GB, TB, "
                "KiB, MiB, GiB or TiB (e.g. 141GiB, 80GB)"
            )
        try:
            value, unit = Decimal(m.group(1)), _UNITS[m.group(2).lower()]
        except InvalidOperation as e:
            raise MemoryPlanError(f"cannot read size {text!r}") from e
    size = int(value * unit)
    if size <= 0:
        raise MemoryPlanError(f"size must be positive, got {text!r}")
    return size


def load_model_metadata(path: str) -> tuple[dict, dict | None]:
    """(config, index or None) from a model directory or a config.json file; reads no weights."""
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
    elif os.path.isfile(path):
        config_path = path
    else:
        raise MemoryPlanError(f"{path!r} is neither a model directory nor a config.json file")
    config = _read_json(config_path, "config")
    index_path = os.path.join(os.path.dirname(config_path), INDEX_FILE)
    index = _read_json(index_path, "index") if os.path.isfile(index_path) else None
    return config, index


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError as e:
        raise MemoryPlanError(f"no {what} file at {path!r}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MemoryPlanError(f"cannot read {what} file {path!r}: {e}") from e
    if not isinstance(value, dict):
        raise MemoryPlanError(f"{what} file {path!r} must hold a JSON object")
    return value


def kv_cache_bytes_per_token(config: dict, kv_dtype: str) -> tuple[str, int]:
    """(layout, bytes per token over all decoder layers) of the engine's paged KV cache."""
    if kv_dtype not in KV_DTYPES:
        raise MemoryPlanError(f"KV dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    layout = checkpoint_tensors(config)
    if layout.architecture == "DeepseekV3ForCausalLM":
        per_layer, kind = field(config, "kv_lora_rank") + field(config, "qk_rope_head_dim"), "mla_latent"
    else:
        heads = field(config, "num_attention_heads")
        kv_heads = field(config, "num_key_value_heads", heads)
        per_layer, kind = 2 * kv_heads * field(config, "head_dim", field(config, "hidden_size") // heads), "full_kv"
    return kind, per_layer * layout.num_layers * DTYPE_BYTES[kv_dtype]


def size_experts(num_slots: int, slot_bytes: int, usable: int) -> ExpertSizing:
    def smallest(copies: int) -> int | None:
        for workers in range(1, num_slots + 1):
            if num_slots % workers == 0 and copies * (num_slots // workers) * slot_bytes <= usable:
                return workers
        return None

    workers = smallest(1)
    if workers is None:
        return ExpertSizing(num_slots, None, None, None, None)
    slots = num_slots // workers
    return ExpertSizing(num_slots, workers, slots, slots * slot_bytes, smallest(2))


def plan_mesh(
    config: dict,
    index: dict | None,
    gpu_memory_bytes: int,
    expert_pods: int | None = None,
    redundant_experts: int = 0,
    kv_tokens: int | None = None,
    kv_dtype: str = "bfloat16",
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    weight_dtype: str | None = None,  # None: as stored (fp8 stays fp8); else every weight at this dtype
) -> MemoryPlan:
    """Raises ModelConfigError (config.json) or MemoryPlanError (the other arguments, the index)."""
    if not 0 <= reserve_fraction < 1:
        raise MemoryPlanError(f"reserve fraction must be in [0, 1), got {reserve_fraction}")
    for name, value in (
        ("redundant experts", redundant_experts),
        ("KV tokens", kv_tokens),
        ("expert pods", expert_pods),
        ("GPU memory", gpu_memory_bytes),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise MemoryPlanError(f"{name} must be a non-negative integer, got {value!r}")
    layout = checkpoint_tensors(config)
    fmt = weight_format(config, weight_dtype)
    notes = []
    if index is None:
        weights, mtp, check = *count_from_config(layout, fmt), None
    else:
        weight_map, total_size = _index_fields(index)
        weights, mtp, check = count_from_index(layout, fmt, weight_map, total_size)
        notes += _index_notes(check, forced=fmt.forced)
    num_mtp_layers = layout.num_mtp_layers if check is None or check.mtp_stored else 0
    if num_mtp_layers:
        notes.append(
            f"{num_mtp_layers} multi-token-prediction layer(s) stored in the checkpoint "
            "are not loaded by the engine and left out of the plan"
        )
    elif layout.num_mtp_layers:
        notes.append(
            f"config.json names {layout.num_mtp_layers} multi-token-prediction layer(s); the index stores none"
        )
    if layout.num_experts == 0 and redundant_experts:
        raise MemoryPlanError(f"{layout.architecture} here has no routed experts; redundant experts must be 0")
    kv_kind, kv_per_token = kv_cache_bytes_per_token(config, kv_dtype)
    usable = int(gpu_memory_bytes * (1 - reserve_fraction))
    slot_bytes, one_copy, with_redundancy = 0, None, None
    if layout.num_experts:
        slot_bytes = -(-weights.routed_experts.bytes // layout.num_experts)
        one_copy = size_experts(layout.num_experts, slot_bytes, usable)
        with_redundancy = size_experts(layout.num_experts + redundant_experts, slot_bytes, usable)
    plan = MemoryPlan(
        architecture=layout.architecture,
        weight_format=fmt.describe(),
        kv_dtype=kv_dtype,
        num_layers=layout.num_layers,
        num_moe_layers=len(layout.moe_layer_ids),
        num_experts=layout.num_experts,
        num_mtp_layers=num_mtp_layers,
        weights=weights,
        mtp_weights=mtp,
        index=check,
        kv_layout=kv_kind,
        kv_bytes_per_token=kv_per_token,
        gpu_memory_bytes=gpu_memory_bytes,
        reserve_fraction=reserve_fraction,
        usable_bytes_per_pod=usable,
        slot_bytes=slot_bytes,
        redundant_experts=redundant_experts,
        one_copy=one_copy,
        with_redundancy=with_redundancy,
        attention_pod_kv_tokens=max(0, usable - weights.non_expert.bytes) // kv_per_token,
        aggregated_pod_kv_tokens=max(0, usable - weights.total.bytes) // kv_per_token,
        kv_tokens=kv_tokens,
        expert_pods=expert_pods,
        expert_pods_problem=None,
        notes=tuple(notes),
    )
    if expert_pods is None:
        return plan
    return dataclasses.replace(plan, expert_pods_problem=check_expert_pods(plan, expert_pods))


def check_expert_pods(plan: MemoryPlan, expert_pods: int) -> str | None:
    """None when `expert_pods` pods hold the plan's slots (experts + redundant), else why not and
    how many expert pods are needed. 0 expert pods: the routed experts stay on the workers."""
    sizing = plan.with_redundancy
    if sizing is None:
        return None  # dense: nothing to place
    gib = plan.usable_bytes_per_pod / 2**30
    if expert_pods == 0:
        if plan.weights.total.bytes <= plan.usable_bytes_per_pod:
            return None
        need = f"at least {sizing.min_workers} expert pods" if sizing.min_workers else "larger GPUs"
        return (
            f"with no expert pods a worker holds every weight ({plan.weights.total.bytes / 2**30:.1f} GiB), more "
            f"than the {gib:.1f} GiB usable per pod: {need} are needed"
        )
    if sizing.min_workers is None or sizing.bytes_per_worker is None:
        return (
            f"one expert slot ({plan.slot_bytes / 2**30:.2f} GiB: an expert in each of {plan.num_moe_layers} MoE "
            f"layers) is more than the {gib:.1f} GiB usable per pod: no expert pod count fits; use larger GPUs"
        )
    need = (
        f"at least {sizing.min_workers} expert pods are needed ({sizing.slots_per_worker} slots, "
        f"{sizing.bytes_per_worker / 2**30:.1f} GiB each)"
    )
    slots = f"{sizing.num_slots} slots ({plan.num_experts} experts + {plan.redundant_experts} redundant)"
    if sizing.num_slots % expert_pods:
        return f"{slots} do not divide evenly over {expert_pods} expert pods; {need}"
    per_pod = sizing.num_slots // expert_pods * plan.slot_bytes
    if per_pod > plan.usable_bytes_per_pod:
        return (
            f"{expert_pods} expert pods would hold {sizing.num_slots // expert_pods} slots = "
            f"{per_pod / 2**30:.1f} GiB each, more than the {gib:.1f} GiB usable per pod; {need}"
        )
    return None


def _index_fields(index: dict) -> tuple[dict[str, str], int | None]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise MemoryPlanError(f"{INDEX_FILE} must have a 'weight_map' object of tensor name -> file")
    total_size = (index.get("metadata") or {}).get("total_size")
    if total_size is not None and (isinstance(total_size, bool) or not isinstance(total_size, int)):
        raise MemoryPlanError(f"{INDEX_FILE} metadata.total_size must be an integer, got {total_size!r}")
    return weight_map, total_size


def _index_notes(check: IndexCheck, forced: bool) -> list[str]:
    notes = []
    if check.num_unknown:
        notes.append(
            f"the index names {check.num_unknown} tensor(s) config.json does not explain (not counted), "
            f"e.g. {list(check.unknown_names)}"
        )
    if check.num_missing:
        notes.append(f"the index lacks {check.num_missing} tensor(s) config.json implies")
    if not forced and check.unaccounted_bytes:
        notes.append(f"the index's total_size differs from the counted bytes by {check.unaccounted_bytes} bytes")
    return notes


__all__ = ["MemoryPlan", "MemoryPlanError", "ModelConfigError", "check_expert_pods", "plan_mesh", "parse_size"]
