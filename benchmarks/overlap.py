"""Execution overlap: offline throughput with async scheduling on vs off on SmolLM2.

    python benchmarks/overlap.py [--dtype float32] [--max-tokens 64] [--batches 1,16,64]

For each number of concurrent requests, the same prompts run through one engine with overlap
(the scheduler prepares round t+1 and processes round t's outputs while the runner thread runs
the model) and one without (rounds one after another). Greedy outputs are checked identical.
The gain is the host work per round (scheduling, input preparation of the next round, output
processing, detokenization) hidden behind the forward; it is largest when forwards are short.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import make_prompts, print_table  # noqa: E402

from moemesh import LLM, SamplingParams  # noqa: E402


class RoundTimer:
    """Wall time of the model (runner.execute) and of the host work around it (schedule, output
    processing) in an engine without overlap: the host share is what overlap can hide."""

    def __init__(self, llm: LLM):
        self.model_s = self.host_s = 0.0
        self.rounds = 0
        engine = llm.engine
        engine.runner.execute = self._timed(engine.runner.execute, "model_s", count=True)
        engine.scheduler.schedule = self._timed(engine.scheduler.schedule, "host_s")
        engine._finish_round = self._timed(engine._finish_round, "host_s")

    def _timed(self, fn, attr: str, count: bool = False):
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)
                self.rounds += count

        return wrapper

    def reset(self) -> None:
        self.model_s = self.host_s = 0.0
        self.rounds = 0


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return num_tokens / elapsed, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        on: LLM(dtype=args.dtype, async_scheduling=on, max_num_seqs=max(batches), show_progress=False)
        for on in (True, False)
    }
    for llm in engines.values():  # warm-up
        llm.generate(make_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))
    timer = RoundTimer(engines[False])
    rows = []
    for batch in batches:
        prompts = make_prompts(batch)
        timer.reset()
        result = {on: run(llm, prompts, args.max_tokens) for on, llm in engines.items()}
        identical = result[True][1] == result[False][1]
        model_ms, host_ms = 1e3 * timer.model_s / timer.rounds, 1e3 * timer.host_s / timer.rounds
        rows.append(
            [
                batch,
                f"{result[False][0]:.1f}",
                f"{result[True][0]:.1f}",
                f"{result[True][0] / result[False][0]:.2f}x",
                f"{model_ms:.1f}",
                f"{host_ms:.2f}",
                f"{1 + host_ms / model_ms:.3f}x",
                "yes" if identical else "NO",
            ]
        )
    print(f"SmolLM2-135M, {args.dtype}, {args.max_tokens} new tokens per request, CPU threads: {os.cpu_count()}")
    print_table(
        [
            "requests",
            "overlap off tok/s",
            "overlap on tok/s",
            "speed-up",
            "model ms/round",
            "host ms/round",
            "bound",
            "identical",
        ],
        rows,
    )
    print(
        "model / host ms per round: measured without overlap (runner.execute vs schedule + output "
        "processing); bound = the speed-up if all host work were hidden"
    )


if __name__ == "__main__":
    main()
