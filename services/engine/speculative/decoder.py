"""The engine's speculation component: before each round, draft tokens for decoding requests
and decide how many of them the round verifies; after it, count what was accepted.

Called by `LLMEngine.step()`: `prepare(running)` before `Scheduler.schedule()`, `record(...)`
after `Scheduler.update_from_output()`. A stateful proposer (the draft model's KV cache) keeps
state only for the requests of its latest `propose` call, so requests that finished or were
preempted are freed at the next `prepare`, which always calls it. The MTP proposer also keeps
requests that are still prefilling, and reads the target's hidden states of every round from
`record` (`needs_hidden_states`: the engine asks the runner for them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import nn

from moemesh.engine.config import ModelConfig, SpecConfig
from moemesh.engine.core.request import Request
from moemesh.engine.runner.hidden_states import TargetHiddenStates
from moemesh.engine.speculative.confidence import CostTable, schedule_draft_lengths
from moemesh.engine.speculative.ngram import NgramProposer
from moemesh.engine.speculative.proposer import NullProposer, Proposer


@dataclass
class SpecStats:
    num_rounds: int = 0  # rounds that verified at least one draft
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    num_verified_requests: int = 0  # (request, round) pairs with drafts

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified request-round: accepted drafts + the one always sampled."""
        if not self.num_verified_requests:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verified_requests

    @property
    def drafts_per_round(self) -> float:
        return self.num_draft_tokens / self.num_rounds if self.num_rounds else 0.0


class SpecDecoder:
    def __init__(
        self,
        config: SpecConfig,
        max_model_len: int,
        cost: CostTable | None,
        target: ModelConfig | None = None,
        target_vocab_size: int | None = None,
        target_model: nn.Module | None = None,
    ):
        """`target` / `target_vocab_size`: the target model's config and vocabulary, needed by
        the draft-model proposer (same device, same vocabulary); `target_model`: the loaded
        target, whose embedding and LM head the MTP proposer shares."""
        self.config = config
        self.max_model_len = max_model_len
        self.cost = cost
        self.proposer: Proposer = NullProposer()
        self._mtp = None  # the MTP proposer, which also reads hidden states
        if config.method == "ngram":
            self.proposer = NgramProposer(config.ngram_min_n, config.ngram_max_n)
        elif config.method == "draft":
            from moemesh.engine.speculative.draft_model import load_draft_proposer

            assert target is not None and target_vocab_size is not None, "a draft model needs the target's config"
            self.proposer = load_draft_proposer(config, target, target_vocab_size)
        elif config.method == "mtp":
            from moemesh.engine.speculative.mtp import load_mtp_proposer

            assert target is not None and target_model is not None, "MTP needs the target model"
            self.proposer = self._mtp = load_mtp_proposer(config, target, target_model)
        self.stats = SpecStats()

    @property
    def needs_hidden_states(self) -> bool:
        """Whether `record` needs the target's hidden states (`ModelRunnerOutput.hidden_states`)."""
        return self._mtp is not None

    def prepare(self, running: list[Request]) -> None:
        """Set `spec_token_ids` on running requests that are decoding (prefill done)."""
        candidates = {}
        for request in running:
            room = min(
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
                self.config.num_speculative_tokens,
            )
            decoding = request.num_computed_tokens == request.num_tokens - 1
            params = request.sampling_params  # adjusted logits: see engine/logits_processors.py
            if decoding and room > 0 and params.logprobs is None and not params.adjusts_logits:
                candidates[request.request_id] = (request, room)
        start = time.perf_counter()
        token_ids = {rid: r.all_token_ids for rid, (r, _) in candidates.items()}
        k = self.config.num_speculative_tokens
        if self._mtp is not None:
            prefilling = {r.request_id for r in running if r.num_computed_tokens < r.num_tokens - 1}
            proposals = self._mtp.propose(token_ids, k, keep=prefilling)
        else:  # also with no candidates: stateful proposers free the rest
            proposals = self.proposer.propose(token_ids, k)
        draft_seconds = time.perf_counter() - start  # part of the round's time, whatever is verified
        if not proposals:
            return
        proposals = {rid: p.truncated(candidates[rid][1]) for rid, p in proposals.items()}
        if self.config.scheduling == "confidence" and self.cost is not None:
            confidences = {rid: p.confidences for rid, p in proposals.items()}
            confidences.update({rid: [] for rid in candidates if rid not in proposals})
            lengths = schedule_draft_lengths(
                confidences, self.cost, num_other_tokens=len(running) - len(candidates), draft_seconds=draft_seconds
            )
        else:
            lengths = {rid: len(p.token_ids) for rid, p in proposals.items()}
        for rid, proposal in proposals.items():
            candidates[rid][0].spec_token_ids = proposal.token_ids[: lengths.get(rid, 0)]

    def record(
        self,
        scheduled_spec: dict[str, list[int]],
        sampled: dict[str, list[int]],
        hidden_states: dict[str, TargetHiddenStates] | None = None,
    ) -> None:
        """After a round: count accepted drafts; hand the round's hidden states to the proposer."""
        if self._mtp is not None and hidden_states:
            self._mtp.observe(hidden_states)
        if not scheduled_spec:
            return
        self.stats.num_rounds += 1
        for rid, drafts in scheduled_spec.items():
            tokens = sampled.get(rid)
            if tokens is None:
                continue
            self.stats.num_verified_requests += 1
            self.stats.num_draft_tokens += len(drafts)
            self.stats.num_accepted_tokens += len(tokens) - 1
