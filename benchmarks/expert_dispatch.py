"""Remote experts over loopback: per-MoE-layer dispatch overhead, per-step latency and tokens/s of
the engine with its routed experts in-process vs on 1, 2 and 4 expert worker processes, for each
expert transport, and the bytes moved per token.

    python benchmarks/expert_dispatch.py [--workers 1 2 4] [--transports grpc grpc-stream torch-dist socket]
                                         [--overlap off on] [--requests 32]

Builds a random Qwen3-MoE checkpoint with transformers (default hidden 1024, 64 experts of 256,
top-8, 2 MoE layers; a decode batch of 32 tokens), then runs the same greedy batch through the
offline engine with `LocalExpertExecutor` and with `RemoteExpertExecutor` over each transport
against expert workers started as `moemesh serve --role expert` (Redis + an even placement, as
`moemesh up --experts N` does). Columns: "step" = median engine step while every request
decodes; "MoE" = the part of a step spent in the expert executor (all MoE layers);
"overhead ms/layer" = (remote MoE - the slowest worker's expert compute of each layer, as the
workers report it in `compute_s`) / MoE layers: what dispatch costs per layer beyond computing the
experts (grouping, serialization, transport, the worker's gRPC/asyncio path, combine); "vs local"
= (remote MoE - local MoE) / MoE layers (with several workers the compute is split, so negative);
"x local tok/s" = the median over `--repeats` passes of (that pass's local step / this
row's step), and "vs local" likewise per pass: each pass runs the local engine, then every
remote row, so a host whose speed drifts moves both sides of a ratio alike (the other cells are
medians over the passes; each cluster's transports and the local engine first run unmeasured). With ping-pong overlap on, a MoE
layer's remote wait overlaps the other micro-batch's attention, so the per-layer columns are
left out ("-"): step time and tokens/s are what overlap changes. "auto" (the serving default) times
the decode rounds both ways for its first rounds and keeps the faster; the cell says which. "floor" = median round trip of an
empty request over that transport (the fixed cost each layer pays per worker, in parallel across
workers);
"waiting" = the part of MoE spent blocked on replies (expert compute + transport + the worker's
gRPC/asyncio overhead), "dispatcher CPU" = the rest (grouping, serialization, combine);
bytes/token = request + reply tensor payload per token over all MoE layers. Outputs are checked
to be identical to the local run (greedy tokens).

`--busy-poll S` (the socket transport's `--expert-busy-poll`, both sides): a wait polls this long
before it blocks. A vCPU that idles through the expert's compute comes back with cold caches
(measured on a 2-vCPU KVM guest: dispatch planning of 32x8 entries 37 us warm, ~390 us after a
20 ms sleep, ~58 us after a 20 ms busy spin), so blocking makes the CPU work around each call
several times slower. Same machine, x1 socket, 2 MoE layers: floor 0.15 -> 0.04 ms and overhead
1.64 -> 1.21 ms/layer with `--busy-poll 0` -> `0.05`. Polling keeps caches only partly warm, less
the longer the wait: on that guest (another day) the whole attention-side submit (planning plus
encoding the request; RemoteExpertExecutor.submit over a fake transport) takes 0.13-0.2 ms after a
4 ms busy spin, 0.34 ms after a 27 ms one (about one expert compute of this shape) and 1.2 ms
after a 20 ms sleep; the expert side streams ~100 MB of
weights per layer between two requests. So the remaining overhead is Python/numpy work run from
cold caches on both sides, and it shrinks with the number of operations on the path, not with
the transport. Hence the dispatch plan and the expert side's checks run as one C call each
(kernels/moe_dispatch.c) and frames view tensors through ctypes instead of torch ops: on a 2-vCPU
Zen 4 guest, x1 socket, overhead 0.93-1.21 -> 0.67-0.81 ms/layer (attention-side submit 513 ->
~295 us). There, after ~100 MB of weights went through the caches, even a bare ctypes call takes
~50 us and np.empty ~14 us (warm: 5 and 0.3 us). And while the socket transport polls, both sides
rehearse the work around the next frame (frame_socket.py keep_warm: the expert side parses and
checks the last request again, the attention side decodes the last reply and plans and encodes
its last request again), which keeps it warm; and a socket reply, which owns its bytes, is the
output without a copy: overhead 0.41-0.57 ms/layer (8 runs of the final code: median 0.45, 7 at
or below 0.5; ~0.7 while the host is busy), dispatcher CPU ~1.0-1.2 -> ~0.5-0.7 ms per step (same
guest, interleaved runs).

The experts themselves: since kernels/cpu_moe.c computes a decode round's expert groups (each
expert's weights read once per four rows, instead of a torch matmul pair per expert that cost
~4x the weights' bytes), the local MoE time of this shape went 46 -> 13 ms a step and the local
row 557 -> ~1,300-1,560 tok/s (same guest). Dispatch overhead is unchanged (x1 socket 0.44-0.54
ms/layer beyond compute), so it weighs ~3.5x more against the compute. `--repeats 5`, x1/x2
socket, three runs: x1 off 0.92-1.02, on 0.92-1.06; x2 off 1.06-1.11, auto (off) 1.03-1.13, on
0.77-0.89. Ping-pong splits the expert side's work badly once that work is bound by the weights'
bytes: a micro-batch of 16 tokens still reaches ~27 of a worker's 32 experts and pays ~60 us of
weight streaming per expert reached, so two micro-batches stream ~1.7x the weights of one batch;
with three processes (engine, two workers) on two vCPUs there is no idle core for the overlap to
win that back. Ping-pong pays where attention weighs and a core is free for it:
`--prompt-tokens 384 --repeats 3`, x1 socket (engine and worker one vCPU each): off 1.01-1.03,
on 1.27 (two runs); x2: off 1.12, on 1.02. `auto`, the serving default, measures both per round
shape and keeps the faster.

Hook for later columns (ping-pong overlap, other transports): `EXTRA_COLUMNS` maps a column name
to a function (llm, remote executor, run result) -> cell text, evaluated for every remote row.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from statistics import median_high

sys.path.insert(0, os.path.dirname(__file__))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import print_table  # noqa: E402

from moemesh import LLM, SamplingParams  # noqa: E402
from moemesh.contracts.placement import PlacementStore  # noqa: E402
from moemesh.contracts.redis_client import connect  # noqa: E402
from moemesh.engine.runner.overlap_tuner import OverlapTuner, round_shape  # noqa: E402
from moemesh.expert.client.remote_executor import RemoteExpertExecutor, RemotePlacement  # noqa: E402
from moemesh.expert.protocol.call import ExpertRequest  # noqa: E402
from moemesh.expert.settings import ExpertSettings  # noqa: E402
from moemesh.expert.transports.base import TRANSPORTS, ExpertCallError  # noqa: E402
from moemesh.expert.transports.factory import make_transport  # noqa: E402
from moemesh.launcher.local_cluster import ClusterSpec, LocalCluster  # noqa: E402


def build_checkpoint(path: str, args) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=512,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(path)


class WaitTimed:
    """Wraps a transport: adds up the seconds the model's thread is blocked on replies."""

    def __init__(self, transport):
        self.transport, self.seconds = transport, 0.0

    def __getattr__(self, name):
        return getattr(self.transport, name)

    def submit(self, worker_id, request, timeout_s):
        call, outer = self.transport.submit(worker_id, request, timeout_s), self

        class _Call:
            def result(self):
                start = time.perf_counter()
                try:
                    return call.result()
                finally:
                    outer.seconds += time.perf_counter() - start

        return _Call()


class Timed:
    """Wraps an executor to add up the seconds the model's thread spends in it (forward, or
    submit + wait under ping-pong overlap, where it excludes the other micro-batch's attention)."""

    def __init__(self, executor):
        self.executor, self.seconds = executor, 0.0

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def _timed(self, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        self.seconds += time.perf_counter() - start
        return out

    def forward(self, *a):
        return self._timed(self.executor.forward, *a)

    def submit(self, *a):
        return self._timed(self.executor.submit, *a)

    def wait(self, handle):
        return self._timed(self.executor.wait, handle)


EXTRA_COLUMNS: dict = {}  # column name -> fn(llm, remote executor, run result tuple) -> str


WARMUP_TOKENS = 8  # an unmeasured run before the local row and before each cluster's rows


def run(llm: LLM, prompts: list[list[int]], new_tokens: int, waits: WaitTimed | None = None, remote=None):
    """(outputs, median decode-step s, MoE s per decode step, waiting s per decode step, tokens per step,
    MoE s per decode step not spent in the slowest worker's expert compute)."""
    engine = llm.engine
    timed = engine.model.moe_runtime.executor
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
    steps, moe, wait, overhead = [], [], [], []
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        moe_before, wait_before, start = timed.seconds, waits.seconds if waits else 0.0, time.perf_counter()
        compute_before = remote.compute_s if remote else 0.0
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if running == len(prompts) and not engine.scheduler.waiting:  # every request decoding
            steps.append(time.perf_counter() - start)
            moe.append(timed.seconds - moe_before)
            wait.append((waits.seconds if waits else 0.0) - wait_before)
            overhead.append(moe[-1] - ((remote.compute_s if remote else 0.0) - compute_before))
    if len(steps) > 4:  # drop fill and drain
        steps, moe, wait, overhead = (v[2:-2] for v in (steps, moe, wait, overhead))
    if not steps:
        raise SystemExit(f"no round had all {len(prompts)} requests decoding: more --new-tokens, or fewer --requests")
    steps, moe, wait, overhead = (sorted(v) for v in (steps, moe, wait, overhead))
    mid = len(steps) // 2
    return [outputs[i] for i in ids], steps[mid], moe[mid], wait[mid], len(prompts), overhead[mid]


def transport_floor(
    kind: str, worker_id: str, endpoint: str, version: int, busy_poll_s: float, repeats: int = 200
) -> float:
    """Median round trip of an empty request over `kind` (refused after the placement lookup, as
    its hidden width is wrong: still a full trip through the transport and the worker's parse)."""
    transport = make_transport(kind, {worker_id: endpoint}, busy_poll_s=busy_poll_s)
    times = []
    try:
        for _ in range(repeats):
            none = np.zeros(0, dtype=np.int32)
            request = ExpertRequest(0, version, torch.zeros(0, 8), none, none, none, none)
            start = time.perf_counter()
            try:
                transport.submit(worker_id, request, 5.0).result()
            except ExpertCallError as e:
                if e.code != "INVALID_ARGUMENT":
                    raise
            times.append(time.perf_counter() - start)
    finally:
        transport.close()
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    p.add_argument(
        "--overlap",
        nargs="+",
        default=["off", "on", "auto"],
        choices=["off", "on", "auto"],
        help="ping-pong micro-batch overlap of the remote rows (auto: measured per round shape, the default)",
    )
    p.add_argument("--requests", type=int, default=32, help="the decode batch (tokens per step)")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of each expert worker")
    p.add_argument(
        "--busy-poll",
        type=float,
        default=ExpertSettings.busy_poll_s,
        help="socket transport: seconds both sides poll before a wait blocks (--expert-busy-poll; 0: block at once)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measured passes over the rows, interleaved with a local run each (a row's cells: medians)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "moe")
        build_checkpoint(path, args)
        llm = LLM(path, num_blocks=1024, max_model_len=512, max_num_seqs=max(64, args.requests), show_progress=False)
        model = llm.engine.model
        local = model.moe_runtime.executor
        num_moe_layers = len(model.moe_layer_ids)
        dtype = local.experts[0].w13.dtype  # what dtype "auto" picked on this CPU

        def run_local():
            model.set_expert_executor(Timed(local))
            llm.engine.runner.micro_batch_overlap = None  # local experts: one batch (not the last row's setting)
            result = run(llm, prompts, args.new_tokens)
            local_runs.append(result)
            return result

        local_runs: list[tuple] = []
        model.set_expert_executor(Timed(local))
        run(llm, prompts, WARMUP_TOKENS)  # first touches (allocator, caches) out of the measured rows
        expected, _, _, _, tokens, _ = run_local()
        for num_workers in args.workers:
            spec = ClusterSpec(
                mesh=f"bench-{num_workers}",
                model=path,
                num_experts=num_workers,
                num_threads=args.threads,
                log_dir=tmp,
                expert_args=("--expert-busy-poll", str(args.busy_poll)),
            )
            cluster = LocalCluster(spec)
            try:
                from moemesh.launcher.local_cluster import RedisServer

                cluster.redis = RedisServer().start()
                cluster.redis_url = cluster.redis.url
                cluster.start_experts()
                client = connect(cluster.redis_url)
                placement = PlacementStore(client, spec.mesh).current()
                client.close()
                endpoints = {s.name: s.grpc_endpoint for s in cluster.services.values()}
                first = next(iter(endpoints))
                floors = {
                    kind: transport_floor(kind, first, endpoints[first], placement.version, args.busy_poll)
                    for kind in args.transports
                }
                for kind in args.transports:  # each transport's first rounds (the workers' too) unmeasured
                    warm = RemoteExpertExecutor(
                        make_transport(kind, endpoints, busy_poll_s=args.busy_poll), RemotePlacement(placement)
                    )
                    model.set_expert_executor(Timed(warm))
                    run(llm, prompts, WARMUP_TOKENS)
                    warm.close()
                configs = list(itertools.product(args.transports, args.overlap))
                passes = {config: [] for config in configs}  # -> [(result, the pass's local result, remote, choice)]
                for _ in range(args.repeats):
                    local_result = run_local()
                    for kind, overlap in configs:
                        waits = WaitTimed(make_transport(kind, endpoints, busy_poll_s=args.busy_poll))
                        remote = RemoteExpertExecutor(waits, RemotePlacement(placement))
                        model.set_expert_executor(Timed(remote))
                        llm.engine.runner.micro_batch_overlap = {"on": True, "off": False, "auto": None}[overlap]
                        llm.engine.runner.overlap_tuner = OverlapTuner()
                        result = run(llm, prompts, args.new_tokens, waits, remote)
                        chosen = llm.engine.runner.overlap_tuner.chosen().get(round_shape(args.requests, True))
                        passes[(kind, overlap)].append((result, local_result, remote, chosen))
                        remote.close()
                llm.engine.runner.micro_batch_overlap = None
                for (kind, overlap), runs in passes.items():
                    rows.append(
                        remote_row(
                            num_workers, kind, overlap, runs, expected, floors[kind], prompts, args, num_moe_layers, llm
                        )
                    )
            finally:
                cluster.stop()
        model.set_expert_executor(local)
        local_step, local_moe = median_high(r[1] for r in local_runs), median_high(r[2] for r in local_runs)
        same = all(r[0] == expected for r in local_runs)
        rows.insert(
            0,
            [
                "local",
                "-",
                "-",
                f"{local_step * 1e3:.1f}",
                f"{tokens / local_step:,.0f}",
                "1.00",
                f"{local_moe * 1e3:.2f}",
                "-",
                "-",
                "-",
                "-",
                "-",
                "0",
                "yes" if same else "NO",
                *["-" for _ in EXTRA_COLUMNS],
            ],
        )
    print(
        f"Qwen3-MoE (random): hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}, "
        f"{num_moe_layers} MoE layers, {str(dtype).removeprefix('torch.')}; decode batch {args.requests} x {args.new_tokens} new tokens; "
        f"{args.threads} torch thread(s) per process, CPU, loopback"
    )
    print_table(
        [
            "experts",
            "transport",
            "overlap",
            "step ms",
            "tokens/s",
            "x local tok/s",
            "MoE ms/step",
            "overhead ms/layer",
            "vs local ms/layer",
            "waiting",
            "dispatcher CPU",
            "floor ms",
            "bytes/token",
            "same output",
            *EXTRA_COLUMNS,
        ],
        rows,
    )


def remote_row(num_workers, kind, overlap, runs, expected, floor, prompts, args, num_moe_layers, llm):
    """The table row of one (workers, transport, overlap) from its passes: medians over the passes;
    "x local" and "vs local" compare each pass with its own local run (which precedes it)."""
    results = [r for r, *_ in runs]
    step, moe, wait = (median_high(r[i] for r in results) for i in (1, 2, 3))
    overhead = median_high(r[5] for r in results) / num_moe_layers
    ratio = median_high(local[1] / r[1] for r, local, *_ in runs)
    versus_local = median_high(r[2] - local[2] for r, local, *_ in runs) / num_moe_layers
    if overlap == "auto":  # what it settled on for the all-decode rounds, in each pass
        picks = ["on" if c else "off" if c is not None else "?" for *_, c in runs]
        overlap = f"auto ({'/'.join(picks) if len(set(picks)) > 1 else picks[0]})"
    result, _, remote, _ = runs[-1]
    moved = (remote.num_bytes_sent + remote.num_bytes_received) / max(1, remote_tokens(prompts, args))
    tokens = result[4]
    serial = overlap == "off"  # the per-layer columns mean something only without overlap
    ms = lambda v, fmt=".2f": f"{v * 1e3:{fmt}}" if serial else "-"  # noqa: E731
    same = "yes" if all(r[0] == expected for r in results) else "NO"
    return [
        f"remote x{num_workers}",
        kind,
        overlap,
        f"{step * 1e3:.1f}",
        f"{tokens / step:,.0f}",
        f"{ratio:.2f}",
        ms(moe),
        ms(overhead),
        ms(versus_local, "+.2f"),
        ms(wait),
        ms(moe - wait),
        f"{floor * 1e3:.2f}",
        f"{moved / 1024:.1f} KiB",
        same,
        *[fn(llm, remote, result) for fn in EXTRA_COLUMNS.values()],
    ]


def remote_tokens(prompts, args) -> int:
    """Tokens that went through the model in one run: prompts plus all but the last new token."""
    return sum(len(p) + args.new_tokens - 1 for p in prompts)


if __name__ == "__main__":
    main()
