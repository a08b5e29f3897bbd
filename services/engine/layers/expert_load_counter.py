"""Per-(MoE layer, logical expert) token counts over a sliding window of steps.

This is the telemetry EPLB consumes (see services/common/expert_load.py for how a worker
publishes it). Counts live on the model's device in a ring of buckets and are only added to
there, so counting never makes the host wait on the device; `counts()` is the one call that reads
them out (and syncs), meant to run rarely (when a telemetry window closes).

Window: `num_buckets` buckets of `steps_per_bucket` steps. `counts()` sums the buckets, so it
covers the current (partial) bucket plus the `num_buckets - 1` before it; with
`steps_per_bucket=1` that is exactly the last `num_buckets` steps. Memory:
num_buckets * num_layers * num_experts int32 on the device (16 x 58 x 256 x 4 B = 0.9 MiB for
DeepSeek-V3 with the defaults).

Callers:
- the model, `begin_step()` once at the start of every forward (one forward = one step);
- each MoE layer, `record(layer, topk_ids)` once per step, right after gating, with *logical*
  expert ids (before any placement maps them to replicas);
- the worker's telemetry loop, `counts()` when it publishes.
"""

from __future__ import annotations

import torch


class ExpertLoadCounter:
    def __init__(self, num_layers: int, num_experts: int, num_buckets: int = 16, steps_per_bucket: int = 64):
        if num_buckets < 1 or steps_per_bucket < 1:
            raise ValueError(f"num_buckets and steps_per_bucket must be >= 1, got {num_buckets}, {steps_per_bucket}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.num_buckets, self.steps_per_bucket = num_buckets, steps_per_bucket
        self.num_steps = 0  # steps begun since creation (or reset)
        self._buckets: torch.Tensor | None = None  # [num_buckets, num_layers, num_experts] int32, made on first use
        self._bucket = 0

    @property
    def window_steps(self) -> int:
        return self.num_buckets * self.steps_per_bucket

    def begin_step(self) -> None:
        """Start a step; every `steps_per_bucket` steps the oldest bucket is cleared and reused."""
        if self.num_steps > 0 and self.num_steps % self.steps_per_bucket == 0:
            self._bucket = (self._bucket + 1) % self.num_buckets
            if self._buckets is not None:
                self._buckets[self._bucket].zero_()
        self.num_steps += 1

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add one token per (token, slot) to its expert. topk_ids [num_tokens, top_k] int64 in
        [0, num_experts): gating never emits anything else, so nothing is checked on the device."""
        buckets = self._buckets_on(topk_ids.device)
        flat_ids = topk_ids.reshape(-1)  # [num_tokens * top_k]
        ones = torch.ones(flat_ids.shape, dtype=torch.int32, device=flat_ids.device)
        buckets[self._bucket, layer].index_add_(0, flat_ids, ones)

    def counts(self) -> torch.Tensor:  # [num_layers, num_experts] int64, on the device
        """Tokens routed to each (MoE layer, logical expert) within the window."""
        if self._buckets is None:
            return torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        return self._buckets.sum(dim=0, dtype=torch.int64)

    def reset(self) -> None:
        self.num_steps, self._bucket = 0, 0
        if self._buckets is not None:
            self._buckets.zero_()

    def _buckets_on(self, device: torch.device) -> torch.Tensor:
        if self._buckets is None or self._buckets.device != device:
            with torch.inference_mode(False):  # a normal tensor: reset() may run outside inference mode
                self._buckets = torch.zeros(
                    self.num_buckets, self.num_layers, self.num_experts, dtype=torch.int32, device=device
                )
        return self._buckets
