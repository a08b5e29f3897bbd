"""Speculative decoding: decode tokens/s and mean accepted length on SmolLM2, one stream.

    python benchmarks/spec_decode.py [--max-tokens 128] [--dtype float32] [--draft-num-layers 24]

Workloads: repetitive (rewrite a given passage, edit code) and open-ended. Rows: no speculation,
n-gram lookup with fixed k, n-gram with confidence-scheduled k (DSpark), and a draft model. The
only small model at hand is SmolLM2-135M itself, so the draft rows use it as its own draft (the
acceptance ceiling: every draft costs a full forward) and cut to its first layers (a
self-speculative draft without extra weights; SmolLM2 is not trained for early exit, so few
drafts pass). Greedy outputs are checked identical to no speculation.
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
from moemesh.engine.loader import default_model_path  # noqa: E402
from moemesh.engine.speculative.decoder import SpecStats  # noqa: E402

PASSAGE = (
    "The lighthouse stood at the edge of the cliff, its white tower striped with red. Every evening "
    "the keeper climbed the spiral stairs, polished the great lens, and lit the lamp that guided the "
    "fishing boats home through the fog."
)
WORKLOADS = {
    "repetitive": [
        [{"role": "user", "content": f"Rewrite this passage word for word, without changes:\n\n{PASSAGE}"}],
        [
            {
                "role": "user",
                "content": "Rename the variable x to count in this code and print it back:\n\n"
                "def total(items):\n    x = 0\n    for item in items:\n        x += item.price * item.quantity\n"
                "    return x\n",
            }
        ],
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
    parser.add_argument("--draft-num-layers", type=int, default=24, help="layers of the cut SmolLM2 draft (of 30)")
    args = parser.parse_args()
    model, k, layers = default_model_path(), args.k, args.draft_num_layers
    configs = {
        "none": SpecConfig(),
        f"ngram fixed k={k}": SpecConfig(method="ngram", scheduling="fixed", num_speculative_tokens=k),
        f"ngram confidence k<={k}": SpecConfig(method="ngram", scheduling="confidence", num_speculative_tokens=k),
        f"draft itself fixed k={k}": SpecConfig(
            method="draft", draft_model=model, scheduling="fixed", num_speculative_tokens=k
        ),
        f"draft {layers}/30 layers fixed k={k}": SpecConfig(
            method="draft", draft_model=model, draft_num_layers=layers, scheduling="fixed", num_speculative_tokens=k
        ),
        f"draft {layers}/30 layers confidence k<={k}": SpecConfig(
            method="draft",
            draft_model=model,
            draft_num_layers=layers,
            scheduling="confidence",
            num_speculative_tokens=k,
        ),
    }
    results: dict[tuple[str, str], tuple[float, list[list[int]], SpecStats]] = {}
    for name, spec in configs.items():  # one engine per configuration, both workloads
        llm = LLM(model, dtype=args.dtype, speculative=spec, show_progress=False)
        for workload, conversations in WORKLOADS.items():
            llm.chat(conversations[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            llm.engine.spec.stats = SpecStats()  # this workload's rounds only
            rate, outputs = run(llm, conversations, args.max_tokens)
            results[workload, name] = rate, outputs, llm.engine.spec.stats
        del llm
    rows = []
    for workload in WORKLOADS:
        baseline_rate, baseline, _ = results[workload, "none"]
        for name, spec in configs.items():
            rate, outputs, stats = results[workload, name]
            rows.append(
                [
                    workload,
                    name,
                    f"{rate:.1f}",
                    f"{rate / baseline_rate:.2f}x",
                    f"{stats.mean_accepted_length:.2f}" if spec.enabled else "-",
                    f"{stats.acceptance_rate:.2f}" if spec.enabled else "-",
                    "yes" if outputs == baseline else "NO",
                ]
            )
    print_table(
        ["workload", "speculation", "decode tok/s", "speed-up", "mean accepted", "acceptance", "identical"], rows
    )


if __name__ == "__main__":
    main()
