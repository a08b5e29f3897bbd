"""The proposer interface: who drafts the next tokens of running requests.

Called by the engine once per round, before scheduling, for the requests that are decoding.
A proposal carries per-token confidences (the DSpark scheduler's input) and, when the proposer
has a distribution, the draft probabilities that rejection sampling needs; a deterministic
proposer (n-gram lookup) proposes point masses, for which `draft_probs` is None.

A proposer that drafts from the target model's hidden states (MTP) reads them from every round's
`ModelRunnerOutput.hidden_states` (`TargetHiddenStates` per scheduled request, runner/hidden_states.py); the runner fills
that only when the engine's proposer asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftProposal:
    token_ids: list[int]  # up to k draft tokens
    confidences: list[float]  # per draft token, in [0, 1]: estimated P(accept | previous accepted)
    draft_probs: torch.Tensor | None = None  # [k, vocab] float32, or None for point masses

    def truncated(self, k: int) -> DraftProposal:
        probs = None if self.draft_probs is None else self.draft_probs[:k]
        return DraftProposal(self.token_ids[:k], self.confidences[:k], probs)


class Proposer(Protocol):
    def propose(self, token_ids: dict[str, list[int]], max_num_tokens: int) -> dict[str, DraftProposal]:
        """Drafts for each request id given all its tokens so far (prompt + output). Requests
        without a useful draft may be absent from the result. A proposer with per-request state
        (the draft model's KV cache) keeps it only for the ids of its latest call."""
        ...


class NullProposer:
    """No speculation."""

    def propose(self, token_ids: dict[str, list[int]], max_num_tokens: int) -> dict[str, DraftProposal]:
        return {}
