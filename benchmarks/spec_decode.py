"""Speculative decoding: decode tokens/s and mean accepted length on SmolLM2, one stream.

    python benchmarks/spec_decode.py [--max-tokens 128] [--dtype float32]

Workloads: repetitive (rewrite a given passage, edit code) and open-ended. Rows: no speculation,
n-gram lookup with fixed k, n-gram with confidence-scheduled k (DSpark). Greedy outputs are
checked identical to no speculation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import print_table  # noqa: E402

from moemesh import LLM, SamplingParams  # noqa: E402
from moemesh.engine.config import SpecConfig  # noqa: E402

PASSAGE = (
    "The lighthouse stood at the edge of the cliff, its white tower striped with red. Every evening "
    "the keeper climbed the spiral stairs, polished the great lens, and lit the lamp that guided the "
    "fishing boats home through the fog."
)
WORKLOADS = {
    "repetitive": [
        [{"role": "user", "content": f"Rewrite this passage word for word, without changes:\n\n{PASSAGE}"}],
        [{"role": "user", "content": "Rename the variable x to count in this code and print it back:\n\n"
          "def total(items):\n    x = 0\n    for item in items:\n        x += item.price * item.quantity\n"
          "    return x\n"}],
    ],
    "open-ended": [
        [{"role": "user", "content": "Write a short story about a robot learning to paint."}],
        [{"role": "user", "content": "What are the benefits of regular exercise?"}],
    ],
}


def run(llm: LLM, conversations, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens, outputs, elapsed = 0, [], 0.0
    for conversation in conversations:  # one stream at a time
        start = time.perf_counter()
        out = llm.chat(conversation, params)[0]
        elapsed += time.perf_counter() - start
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    return tokens / elapsed, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    configs = {
        "none": SpecConfig(),
        f"ngram fixed k={args.k}": SpecConfig(method="ngram", scheduling="fixed", num_speculative_tokens=args.k),
        f"ngram confidence k<={args.k}": SpecConfig(method="ngram", scheduling="confidence",
                                                   num_speculative_tokens=args.k),  # fmt: skip
    }
    rows = []
    for workload, conversations in WORKLOADS.items():
        baseline_rate, baseline = None, None
        for name, spec in configs.items():
            llm = LLM(dtype=args.dtype, speculative=spec, show_progress=False)
            llm.chat(conversations[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            rate, outputs = run(llm, conversations, args.max_tokens)
            stats = llm.engine.stats()
            if baseline is None:
                baseline_rate, baseline = rate, outputs
            rows.append([workload, name, f"{rate:.1f}", f"{rate / baseline_rate:.2f}x",
                         f"{stats['spec_mean_accepted_length']:.2f}" if spec.enabled else "-",
                         f"{stats['spec_acceptance_rate']:.2f}" if spec.enabled else "-",
                         "yes" if outputs == baseline else "NO"])  # fmt: skip
            print_table(["workload", "speculation", "decode tok/s", "speed-up", "mean accepted", "acceptance",
                         "identical"], rows)  # fmt: skip
            del llm


if __name__ == "__main__":
    main()
