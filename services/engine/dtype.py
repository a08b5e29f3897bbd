"""`dtype="auto"`: the activation dtype the hardware computes fast, resolved once at start-up.

bfloat16 on a GPU and on a CPU with native bf16 arithmetic (`avx512_bf16` or `amx_bf16` among the
/proc/cpuinfo flags), float32 otherwise. An explicit bfloat16 on a CPU without them still runs
(PyTorch emulates it through float32) but slowly, so that is warned about once.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_warned: set[str] = set()


def read_cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


cpu_flags = read_cpu_flags  # what resolution reads (tests replace it to force a branch)


def has_native_bf16() -> bool:
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def resolve_dtype(dtype: str, device: str) -> str:
    """ "auto" -> "bfloat16" or "float32" (logged); any other dtype as given."""
    on_cpu = torch.device(device).type == "cpu"
    if dtype == "auto":
        if not on_cpu:
            resolved, why = "bfloat16", f"on {device}"
        elif has_native_bf16():
            resolved, why = "bfloat16", "the CPU has native bf16 (" + ", ".join(NATIVE_BF16_FLAGS) + ")"
        else:
            resolved, why = "float32", "the CPU has no native bf16 (" + " / ".join(NATIVE_BF16_FLAGS) + ")"
        log.info("dtype auto -> %s: %s", resolved, why)
        return resolved
    if dtype == "bfloat16" and on_cpu and not has_native_bf16() and dtype not in _warned:
        _warned.add(dtype)
        log.warning(
            "dtype bfloat16 on a CPU without native bf16 (%s): PyTorch emulates it, expect it to be "
            "slower than float32 (dtype auto picks float32 here)",
            " / ".join(NATIVE_BF16_FLAGS),
        )
    return dtype
