"""Shared helpers for benchmark scripts: workload prompts and table printing."""

from __future__ import annotations

TOPICS = [
    "the history of the printing press",
    "how volcanoes form",
    "a recipe for tomato soup",
    "the rules of chess",
    "why the sky is blue",
    "a day in the life of a lighthouse keeper",
    "the water cycle",
    "how to train for a marathon",
    "the life of honey bees",
    "the invention of the telephone",
    "black holes",
    "a trip to the mountains",
]


def make_prompts(num: int) -> list[str]:
    """Distinct prompts of varied length (about 15 to 60 tokens)."""
    prompts = []
    for i in range(num):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Please be detailed, precise and clear." * (i % 5)
        prompts.append(f"Request {i}: write a short essay about {topic}.{detail} Begin:")
    return prompts


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in row] for row in [headers] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+".join("-" * (w + 2) for w in widths)
    print(line)
    for j, row in enumerate(cells):
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))
        if j == 0:
            print(line)
    print(line)


_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")


def cpu_flags() -> list[str]:
    """The /proc/cpuinfo flags that decide which PyTorch CPU kernels are vectorized."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in _FLAGS if f in flags]
