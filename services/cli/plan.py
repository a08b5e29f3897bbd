"""`moemesh plan --model DIR_OR_CONFIG --gpu-memory 141GiB`: how many pods a model needs, from
its config.json (and model.safetensors.index.json when present; no weights are read). See
common/memory_plan.py for what is sized and the reserve per pod.

Exit status: 0 the plan fits what was asked; 1 it does not (`--kv-tokens` beyond what an
attention pod holds, or `--expert-pods` too few); 2 bad input (unreadable file, unsupported
config, bad size), with the reason on stderr."""

from __future__ import annotations

import dataclasses
import json
import sys

from moemesh.planning.checkpoint_tensors import TENSOR_CLASSES, ModelConfigError
from moemesh.planning.memory_plan import (
    DEFAULT_RESERVE_FRACTION,
    KV_DTYPES,
    MemoryPlan,
    MemoryPlanError,
    load_model_metadata,
    parse_size,
    plan_mesh,
)
from moemesh.planning.weight_bytes import WeightTotals


def add_plan_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="model directory or its config.json")
    parser.add_argument("--gpu-memory", required=True, help="GPU memory per pod: 141GiB, 80GB or bytes")
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV tokens an attention pod must hold")
    parser.add_argument("--dtype", default="bfloat16", choices=KV_DTYPES, help="KV cache dtype (default bfloat16)")
    parser.add_argument(
        "--weight-dtype",
        default=None,
        choices=KV_DTYPES,
        help="size every weight at this dtype (dequantized); default: as stored",
    )
    parser.add_argument("--redundant-experts", type=int, default=0, help="extra replicas per MoE layer (EPLB)")
    parser.add_argument("--expert-pods", type=int, default=None, help="check that this many expert pods fit")
    parser.add_argument(
        "--reserve-fraction",
        type=float,
        default=DEFAULT_RESERVE_FRACTION,
        help="GPU memory kept for activations, CUDA context and buffers (default 0.1)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run_plan)


def run_plan(args) -> int:
    try:
        gpu_memory = parse_size(args.gpu_memory)
        config, index = load_model_metadata(args.model)
        plan = plan_mesh(
            config,
            index,
            gpu_memory,
            expert_pods=args.expert_pods,
            redundant_experts=args.redundant_experts,
            kv_tokens=args.kv_tokens,
            kv_dtype=args.dtype,
            reserve_fraction=args.reserve_fraction,
            weight_dtype=args.weight_dtype,
        )
    except (MemoryPlanError, ModelConfigError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else format_plan(plan))
    fits = plan.expert_pods_problem is None and kv_fits(plan)
    return 0 if fits else 1


def kv_fits(plan: MemoryPlan) -> bool:
    return plan.kv_tokens is None or plan.kv_tokens <= plan.attention_pod_kv_tokens


def plan_to_dict(plan: MemoryPlan) -> dict:
    out = dataclasses.asdict(plan)
    for key in ("weights", "mtp_weights"):
        totals: WeightTotals = getattr(plan, key)
        out[key]["non_expert"] = dataclasses.asdict(totals.non_expert)
        out[key]["total"] = dataclasses.asdict(totals.total)
    if plan.index is not None:
        out["index"]["unaccounted_bytes"] = plan.index.unaccounted_bytes
    out["kv_tokens_fit"] = kv_fits(plan)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def format_plan(plan: MemoryPlan) -> str:
    w = plan.weights
    moe = f", {plan.num_moe_layers} MoE with {plan.num_experts} experts" if plan.num_experts else ", dense"
    lines = [
        f"model: {plan.architecture}, {plan.num_layers} layers{moe}; weights as {plan.weight_format}",
        "source: config.json" + ("" if plan.index is None else f" + index ({plan.index.num_tensors} tensors)"),
        "",
        f"{'weights the engine loads':<28}{'params':>18}{'bytes':>20}",
    ]
    for name in TENSOR_CLASSES:
        count = getattr(w, name)
        if count.params or count.bytes:
            lines.append(f"  {name:<26}{count.params:>18,}{_gib(count.bytes):>20}")
    for label, count in (("non-expert total", w.non_expert), ("routed experts", w.routed_experts), ("total", w.total)):
        lines.append(f"  {label:<26}{count.params:>18,}{_gib(count.bytes):>20}")
    if plan.num_mtp_layers:
        m = plan.mtp_weights.total
        lines.append(f"  MTP layers ({plan.num_mtp_layers}, stored, not loaded): {m.params:,} params, {_gib(m.bytes)}")
    kv = "MLA latent" if plan.kv_layout == "mla_latent" else "K and V"
    lines += [
        "",
        f"KV cache ({kv}, {plan.kv_dtype}): {plan.kv_bytes_per_token:,} bytes per token over {plan.num_layers} layers",
        f"per pod: {_gib(plan.gpu_memory_bytes)} - {plan.reserve_fraction:.0%} reserve (activations, CUDA context, "
        f"buffers) = {_gib(plan.usable_bytes_per_pod)} usable",
    ]
    if plan.one_copy is not None:
        lines.append(f"expert slot (one expert in all {plan.num_moe_layers} MoE layers): {_gib(plan.slot_bytes)}")
        sizings = [("one copy of every expert", plan.one_copy)]
        if plan.redundant_experts:
            sizings.append((f"with {plan.redundant_experts} redundant replicas", plan.with_redundancy))
        for label, s in sizings:
            if s.min_workers is None:
                lines.append(f"  {label} ({s.num_slots} slots): no pod holds even one slot")
                continue
            rebalance = s.min_workers_for_rebalance or "no count of"
            lines.append(
                f"  {label} ({s.num_slots} slots): >= {s.min_workers} expert pods "
                f"({s.slots_per_worker} slots, {_gib(s.bytes_per_worker)} each); "
                f"{rebalance} to hold two placement versions during a rebalance"
            )
    if w.non_expert.bytes > plan.usable_bytes_per_pod:
        lines.append(f"attention pod: {_gib(w.non_expert.bytes)} of weights: does not fit")
    else:
        lines.append(
            f"attention pod: {_gib(w.non_expert.bytes)} of weights; KV for "
            f"{plan.attention_pod_kv_tokens:,} tokens fits beside them"
        )
    if plan.num_experts and w.total.bytes > plan.usable_bytes_per_pod:
        lines.append(f"one pod with every weight ({_gib(w.total.bytes)}): does not fit")
    elif plan.num_experts:
        lines.append(f"one pod with every weight: KV for {plan.aggregated_pod_kv_tokens:,} tokens fits beside them")
    if plan.kv_tokens is not None:
        need = plan.kv_tokens * plan.kv_bytes_per_token
        verdict = "fits" if kv_fits(plan) else "does NOT fit"
        lines.append(f"requested KV: {plan.kv_tokens:,} tokens = {_gib(need)}: {verdict} on an attention pod")
    if plan.expert_pods is not None:
        lines.append(f"{plan.expert_pods} expert pods: " + (plan.expert_pods_problem or "fit"))
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
