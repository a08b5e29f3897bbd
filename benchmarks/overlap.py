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


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outputs)
    steps_per_s = num_tokens / len(prompts) / elapsed  # rounds per second once decoding
    return num_tokens / elapsed, [o.token_ids for o in outputs], steps_per_s


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
    rows = []
    for batch in batches:
        prompts = make_prompts(batch)
        result = {on: run(llm, prompts, args.max_tokens) for on, llm in engines.items()}
        identical = result[True][1] == result[False][1]
        rows.append([
            batch, f"{result[False][0]:.1f}", f"{result[True][0]:.1f}",
            f"{result[True][0] / result[False][0]:.2f}x", f"{result[True][2]:.1f}", "yes" if identical else "NO",
        ])  # fmt: skip
    print(f"SmolLM2-135M, {args.dtype}, {args.max_tokens} new tokens per request, CPU threads: "
          f"{os.cpu_count()}")  # fmt: skip
    print_table(["requests", "overlap off tok/s", "overlap on tok/s", "speed-up", "rounds/s (on)", "identical"], rows)


if __name__ == "__main__":
    main()
