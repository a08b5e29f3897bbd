"""Prompt / n-gram lookup proposer: no weights, drafts copied from earlier in the sequence.

For the longest suffix n-gram (max_n down to min_n) that occurred before, every earlier
occurrence votes for the tokens that followed it. Draft token j is the majority vote at offset j
among the occurrences still agreeing with the drafts before it. Its confidence is the
Laplace-smoothed agreement of those votes, shrunk by the match length:

    c_j = (agree_j + 1) / (num_voters_j + 2) * n / (n + 1)

so a long match repeated many times gives confidences near 1, and a single short match about
1/3 to 1/2. Confidences feed the DSpark scheduler (confidence.py); they never affect outputs.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from moemesh.engine.speculative.proposer import DraftProposal


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4, max_occurrences: int = 32):
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n, self.max_occurrences = min_n, max_n, max_occurrences

    def propose(self, token_ids: dict[str, list[int]], max_num_tokens: int) -> dict[str, DraftProposal]:
        proposals = {}
        for request_id, tokens in token_ids.items():
            proposal = self.propose_one(tokens, max_num_tokens)
            if proposal is not None:
                proposals[request_id] = proposal
        return proposals

    def propose_one(self, tokens: list[int], k: int) -> DraftProposal | None:
        if k <= 0 or len(tokens) <= self.min_n:
            return None
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            starts = _occurrences(seq, n)[-self.max_occurrences :]
            if len(starts) == 0:
                continue
            return self._vote(seq, starts + n, n, k)
        return None

    def _vote(self, seq: np.ndarray, follow: np.ndarray, n: int, k: int) -> DraftProposal | None:
        """follow: index of the token after each earlier occurrence of the suffix n-gram."""
        draft, confidences = [], []
        voters = follow
        for j in range(k):
            voters = voters[voters + j < len(seq)]
            if len(voters) == 0:
                break
            votes = Counter(seq[voters + j].tolist())
            token, agree = max(votes.items(), key=lambda kv: (kv[1], -kv[0]))
            draft.append(token)
            confidences.append((agree + 1) / (len(voters) + 2) * n / (n + 1))
            voters = voters[seq[voters + j] == token]
        return DraftProposal(draft, confidences) if draft else None


def _occurrences(seq: np.ndarray, n: int) -> np.ndarray:
    """Start indices i < len - n where seq[i:i+n] equals the last n tokens (vectorized)."""
    suffix = seq[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [len - n, n], excludes the suffix itself
    return np.nonzero((windows == suffix).all(axis=1))[0]
