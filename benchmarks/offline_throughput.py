"""Offline throughput: moemesh vs Hugging Face transformers and llama.cpp on the same prompts, same run.

    python benchmarks/offline_throughput.py [--num-requests 64] [--max-tokens 128] [--skip-hf-continuous]
                                            [--threads N] [--repeats N]

Greedy, ignore_eos, `--max-tokens` new tokens per request, at 1 request and at each
`--num-requests`. Rows:
- moemesh quantized: bfloat16 activations, the GGUF's Q4_1/Q8_0 weights kept quantized
  (what dtype / quantization "auto" pick on a CPU with native bf16); a round of one request runs
  every layer in one C call (models/llama_int4_decode.py), larger rounds the eager layers with
  the weights as code blocks (kernels/csrc/code_blocks.h: bf16 dot products with AVX512-BF16), or
  int4pack up to 8 rows and C-rebuilt weights + dense bf16 matmuls above on other CPUs;
- moemesh quantized float32: float32 activations on the same quantized weights (what "auto" picks
  without native bf16: the codes in row blocks, kernels/csrc/code_blocks.h, with one C call per
  token at one request, the blocks' C GEMV up to 2 rows and C GEMM above);
- moemesh float32: weights dequantized to float32 at load;
- HF static batching (`generate` with left padding, one batch) and HF continuous batching
  (`generate_batch`), both on the file dequantized to the row's dtype;
- llama.cpp (`llama-cpp-python`, the `bench` extra; never a test dependency) on the same GGUF file,
  as many threads as torch uses; its Python API decodes one sequence at a time, so it runs the
  1-request case only.
Prints tokens/s, the ratio to HF static in the same dtype (and to llama.cpp at 1 request),
resident weight bytes per engine and the CPU flags. `--repeats N`: each engine's best of N timed
runs (every engine alike), for a shared machine whose speed drifts between runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_flags, make_prompts, print_table  # noqa: E402

from moemesh import LLM, SamplingParams  # noqa: E402
from moemesh.engine.loader import default_model_path  # noqa: E402

# row -> (dtype, quantization); HF runs once per dtype
ENGINES = {"quantized": ("bfloat16", "gguf"), "quantized float32": ("float32", "gguf"), "float32": ("float32", "none")}


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
    kwargs = dict(
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    with torch.inference_mode():
        model.generate(
            batch["input_ids"][:2],
            attention_mask=batch["attention_mask"][:2],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        start = time.perf_counter()
        out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompt_ids) / elapsed


def run_hf_continuous(model, prompt_ids: list[list[int]], max_tokens: int) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    with torch.inference_mode():
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompt_ids, generation_config=config)
        elapsed = time.perf_counter() - start
    return sum(len(r.generated_tokens) for r in results.values()) / elapsed


def run_llama_cpp(path: str, prompt_ids: list[int], max_tokens: int, repeats: int = 1) -> tuple[float, str] | None:
    """(tokens/s of one greedy sequence, how llama.cpp ran), or None when it is not installed.

    Each try runs in a child process: llama.cpp's default CPU path repacks the weights into its
    AVX-512 / AMX layouts, and on one KVM guest that path died of a general-protection fault
    (SIGSEGV) inside libggml-cpu. A crashed try is retried without the repacked buffers
    (`use_extra_bufts=False`), and the row says so."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    ctx = multiprocessing.get_context("spawn")
    threads = torch.get_num_threads()
    for repack, how in ((True, "default"), (False, "no weight repacking (the default path crashed here)")):
        queue = ctx.Queue()
        child = ctx.Process(
            target=_llama_cpp_child, args=(path, prompt_ids, max_tokens, threads, repack, queue, repeats)
        )
        child.start()
        child.join()
        if child.exitcode == 0:
            return queue.get(), how
        print(f"llama.cpp ({'default' if repack else 'no repacking'}) exited with {child.exitcode}")
    return float("nan"), "crashed"


def _llama_cpp_child(path, prompt_ids, max_tokens, threads, repack, queue, repeats=1) -> None:
    """Tokens/s of one greedy sequence (EOS ignored: the generator is simply read max_tokens times);
    the prompt is evaluated inside the timing, as moemesh's and HF's prefill are."""
    import llama_cpp

    if not repack:
        defaults = llama_cpp.llama_model_default_params

        def no_repacking():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = llama_cpp.llama_model_default_params = no_repacking
    llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    for steps, _ in enumerate(llm.generate(prompt_ids, temp=0.0, reset=True)):  # warm-up
        if steps >= 4:
            break
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        num = 0
        for num, _ in enumerate(llm.generate(prompt_ids, temp=0.0, reset=True), start=1):
            if num >= max_tokens:
                break
        best = max(best, num / (time.perf_counter() - start))
    queue.put(best)


def weight_bytes(module: torch.nn.Module) -> int:
    """Parameters and buffers once each, RoPE tables (derived, not weights) left out."""
    tensors = {
        t.data_ptr(): t
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if "cos_sin" not in name and "inv_freq" not in name
    }
    return sum(t.numel() * t.element_size() for t in tensors.values())


def mb(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, nargs="+", default=[64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="each engine's best of this many timed runs")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and llama.cpp threads (default: torch's); on a shared machine 1 avoids "
        "OpenMP barrier stalls (llama.cpp on 2 busy vCPUs: 100 tok/s with 1 thread, 6 with 2)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    file_bytes = os.path.getsize(path)
    counts = [1] + args.num_requests
    prompts = {num: [tokenizer(p).input_ids for p in make_prompts(num)] for num in counts}
    llama_run = run_llama_cpp(path, prompts[1][0], args.max_tokens, args.repeats)
    llama_cpp, llama_how = llama_run if llama_run is not None else (None, "")
    rows, sizes = [], [["GGUF file", mb(file_bytes), "1.00x"]]
    if llama_cpp is not None:
        sizes.append(["llama.cpp (mmaps the file)", mb(file_bytes), "1.00x"])
    hf_models, static_runs = {}, {}
    for engine, (dtype, quantization) in ENGINES.items():
        torch_dtype = getattr(torch, dtype)
        if dtype not in hf_models:
            hf_models.clear()  # one HF model resident at a time
            hf_models[dtype] = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype).eval()
            sizes.append(
                [
                    f"HF {dtype}",
                    mb(weight_bytes(hf_models[dtype])),
                    f"{weight_bytes(hf_models[dtype]) / file_bytes:.2f}x",
                ]
            )
        hf = hf_models[dtype]
        # no prefix caching: the warm-up's and an earlier repeat's prompts would skip prefill work HF does
        llm = LLM(
            path,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=max(counts),
            show_progress=False,
            enable_prefix_caching=False,
        )
        sizes.append(
            [
                f"moemesh {engine}",
                mb(weight_bytes(llm.engine.model)),
                f"{weight_bytes(llm.engine.model) / file_bytes:.2f}x",
            ]
        )
        for num in counts:
            ours = max(run_moemesh(llm, prompts[num], args.max_tokens) for _ in range(args.repeats))
            vs_llama = f"{ours / llama_cpp:.2f}x" if num == 1 and llama_cpp else "-"
            first = (dtype, num) not in static_runs
            if first:
                static_runs[dtype, num] = max(
                    run_hf_static(hf, tokenizer, prompts[num], args.max_tokens) for _ in range(args.repeats)
                )
            static = static_runs[dtype, num]
            rows.append([dtype, num, f"moemesh {engine}", f"{ours:.1f}", f"{ours / static:.2f}x", vs_llama])
            if first:
                rows.append([dtype, num, "HF static batching", f"{static:.1f}", "1.00x", "-"])
            if first and not args.skip_hf_continuous and num > 1:
                try:
                    cb = f"{run_hf_continuous(hf, prompts[num], args.max_tokens):.1f}"
                    ratio = f"{float(cb) / static:.2f}x"
                except Exception as e:  # report, don't hide, a peer that fails here
                    cb, ratio = f"failed: {type(e).__name__}", "-"
                rows.append([dtype, num, "HF continuous batching", cb, ratio, "-"])
            print_table(["dtype", "requests", "engine", "tok/s", "vs HF static", "vs llama.cpp"], rows)
        del llm
    hf_models.clear()
    if llama_cpp is None:
        print("llama.cpp: not installed (pip install -e '.[bench]')")
    else:
        print(f"llama.cpp (GGUF as is), 1 request: {llama_cpp:.1f} tok/s; {llama_how}")
    print_table(["weights", "resident bytes", "vs GGUF file"], sizes)
    print(
        f"\n{args.max_tokens} new tokens per request, greedy, ignore_eos, best of {args.repeats}; "
        f"torch threads: {torch.get_num_threads()}; "
        f"torch {torch.__version__}; CPU flags: {' '.join(cpu_flags()) or 'none of the listed'}"
    )


if __name__ == "__main__":
    main()
