"""The routed experts of a decode round on the CPU: csrc/cpu_moe.c's `grouped_moe`, one ctypes call for
a layer's groups (an expert and its entries), what kernels/moe.py's grouped_moe_ref computes.

At a decode round each expert gets a few rows, and a torch matmul of so few rows by an expert's
weights costs several times the weights' bytes (measured on a 2-vCPU Zen 4 guest, one thread,
64 experts of hidden 1024 x intermediate 256 in bfloat16: the reference's layer takes ~21-29 ms at
1 to 16 rows per expert, about 4 GB/s of weights). The C kernel reads each expert's weights
once per four rows.

kernels/dispatch.py calls it for CPU tensors of float32 or bfloat16 with hidden and intermediate
sizes that are multiples of 32, and the torch reference otherwise. Every group goes through the
kernel, large ones too: an entry's bits must not depend on which other tokens share its round
(ping-pong's micro-batches give the un-split round's greedy tokens), and the kernel and torch's
matmuls round differently. Choosing by group size (torch's matmuls above 16 rows) changed the
tokens of a bf16 random Qwen3-MoE between ping-pong on and off: a prefill group crossed the
bound in one mode and not in the other. The cost is prefill's: at 64 and 128 rows per expert the
kernel takes 1.35-1.43x torch's time in bf16, 1.07-1.14x in float32 (same guest; at 32 rows it
is even); decode rounds, a few rows per expert, are where it gains.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from moemesh.kernels.c_library import CSRC, NATIVE_FLAGS, compile_library

log = logging.getLogger(__name__)

SOURCE = CSRC / "cpu_moe.c"
DTYPES = (torch.float32, torch.bfloat16)
ALIGN = 32  # hidden and intermediate sizes: multiples of this (the kernel's vector loops)


@functools.lru_cache(maxsize=4)
def build(target_flags: tuple[str, ...] = NATIVE_FLAGS) -> ctypes.CDLL | None:
    lib = compile_library(SOURCE, target_flags, "the routed experts run as torch matmuls")
    if lib is None:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.grouped_moe.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i32, i32]
    lib.grouped_moe.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    return build(NATIVE_FLAGS)


def usable(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The C kernel reads these tensors."""
    return (
        hidden_states.dtype in DTYPES
        and hidden_states.device.type == "cpu"
        and hidden_states.dim() == 2
        and hidden_states.stride(1) == 1
        and w13.dtype == w2.dtype == hidden_states.dtype
        and w13.device.type == w2.device.type == "cpu"
        and w13.dim() == w2.dim() == 3
        and w13.is_contiguous()
        and w2.is_contiguous()
        and w13.shape[2] == w2.shape[1] == hidden_states.shape[1]
        and w13.shape[1] == 2 * w2.shape[2]
        and w13.shape[0] == w2.shape[0]
        and hidden_states.shape[1] % ALIGN == 0
        and w2.shape[2] % ALIGN == 0
        and library() is not None
    )


def grouped_moe(
    hidden_states: torch.Tensor,  # [num_tokens, hidden], rows dense
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden], hidden_states' dtype
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    row_ids: torch.Tensor,  # [num_entries] int64 rows of hidden_states, grouped by expert
    experts: list[int],  # the expert of each group
    sizes: list[int],  # the entries of each group
    weights: torch.Tensor,  # [num_entries] float32
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [num_tokens, hidden] float32
    """Per row of hidden_states, the float32 sum of weight * E(x) over its entries, in group and
    entry order (grouped_moe_ref's contract). An expert or row id out of range raises IndexError."""
    lib = lib or library()
    num_entries = sum(sizes)
    if len(experts) != len(sizes) or row_ids.numel() != num_entries or weights.numel() != num_entries:
        raise ValueError(
            f"grouped_moe: {len(experts)} experts, {len(sizes)} sizes ({num_entries} entries), "
            f"{row_ids.numel()} row ids, {weights.numel()} weights"
        )
    row_ids = row_ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    groups = torch.tensor([experts, sizes], dtype=torch.int64)  # [2, num_groups]
    num_tokens, hidden = hidden_states.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    rc = lib.grouped_moe(
        hidden_states.data_ptr(),
        hidden_states.stride(0),
        num_tokens,
        w13.data_ptr(),
        w2.data_ptr(),
        w13.shape[0],
        hidden,
        w2.shape[2],
        row_ids.data_ptr(),
        groups[0].data_ptr(),
        groups[1].data_ptr(),
        len(experts),
        weights.data_ptr(),
        out.data_ptr(),
        int(hidden_states.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if rc == -1:
        raise IndexError(f"grouped_moe: an expert id (of {w13.shape[0]}) or row id (of {num_tokens}) is out of range")
    if rc != 0:
        raise MemoryError(f"grouped_moe: no memory for {row_ids.numel()} entries' activations")
    return out
