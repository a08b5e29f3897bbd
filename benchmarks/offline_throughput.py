"""Offline throughput: moemesh vs Hugging Face transformers on the same prompts, same run.

    python benchmarks/offline_throughput.py [--num-requests 16 64] [--dtypes float32 bfloat16]

Greedy, ignore_eos, 128 new tokens per request. Peers: HF static batching (`generate` with left
padding, one batch) and HF continuous batching (`generate_batch`). Also single-request decode.
Prints tokens/s and the ratio to HF static in the same dtype.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import make_prompts, print_table  # noqa: E402

from moemesh import LLM, SamplingParams  # noqa: E402
from moemesh.engine.loader import default_model_path  # noqa: E402


def run_moemesh(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt_ids[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def run_hf_static(model, tokenizer, prompt_ids: list[list[int]], max_tokens: int) -> float:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt")
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    with torch.inference_mode():
        model.generate(batch["input_ids"][:2], attention_mask=batch["attention_mask"][:2], max_new_tokens=4,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        start = time.perf_counter()
        out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompt_ids) / elapsed


def run_hf_continuous(model, prompt_ids: list[list[int]], max_tokens: int) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)  # fmt: skip
    with torch.inference_mode():
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompt_ids, generation_config=config)
        elapsed = time.perf_counter() - start
    return sum(len(r.generated_tokens) for r in results.values()) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-hf-continuous", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    rows = []
    for dtype in args.dtypes:
        torch_dtype = getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype).eval()
        llm = LLM(path, dtype=dtype, max_num_seqs=max(args.num_requests), show_progress=False)
        for num in [1] + args.num_requests:
            prompt_ids = [tokenizer(p).input_ids for p in make_prompts(num)]
            ours = run_moemesh(llm, prompt_ids, args.max_tokens)
            static = run_hf_static(hf, tokenizer, prompt_ids, args.max_tokens)
            rows.append([dtype, num, "moemesh", f"{ours:.1f}", f"{ours / static:.2f}x"])
            rows.append([dtype, num, "HF static batching", f"{static:.1f}", "1.00x"])
            if not args.skip_hf_continuous and num > 1:
                try:
                    cb = f"{run_hf_continuous(hf, prompt_ids, args.max_tokens):.1f}"
                    ratio = f"{float(cb) / static:.2f}x"
                except Exception as e:  # report, don't hide, a peer that fails here
                    cb, ratio = f"failed: {type(e).__name__}", "-"
                rows.append([dtype, num, "HF continuous batching", cb, ratio])
            print_table(["dtype", "requests", "engine", "tok/s", "vs HF static"], rows)
        del hf, llm
    print(f"\n{args.max_tokens} new tokens per request, greedy, ignore_eos; torch threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
