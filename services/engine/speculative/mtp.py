"""MTP proposer: the target's own multi-token-prediction layer (models/deepseek_mtp.py) drafts k
tokens for every candidate request from the target's hidden states, in its own paged KV cache.

The MTP layer at position p reads the target's hidden state h_p and the token t_{p+1}, and
predicts t_{p+2}. After a round, a request with tokens t_0..t_{n-1} has target hidden states for
positions 0..n-2 (the last token was sampled, not fed), so the MTP layer can run up to position
n-2 and predict t_n: draft 1. Draft j > 1 feeds draft j-1 at the next position with the MTP
layer's own output in place of the target's hidden state (one layer reused, as DeepSeek's
sequential MTP does); those cache entries are overwritten next round.

Per request it keeps the cache window (positions base .. base + num_cached - 1, all computed
from the target's hidden states, so never invalidated: real tokens do not change) and the
target hidden states not fed yet. Each round:

1. `observe` (after the round, from `ModelRunnerOutput.hidden_states`) queues the hidden states
   the target computed for every scheduled request (prefill chunks included);
2. `propose` (before the next round) frees requests that are neither candidates nor still
   prefilling, feeds each candidate the queued hidden states of its real tokens (those of
   rejected drafts are dropped) in one varlen forward over all candidates, and drafts k tokens in
   k - 1 more one-token forwards.

Where the target computed no hidden states (a prefix-cache hit, a prompt prefilled on another
worker), the window starts at the first position it has: drafts lose that context, the output
does not change. Drafts are the MTP head's argmax, proposed as point masses; the confidence of a
draft is the head's probability of it (the DSpark scheduler's input).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moemesh.engine.config import CacheConfig, ModelConfig, SpecConfig
from moemesh.engine.core.block_pool import BlockPool, KVCacheBlock
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import DTYPES, build_mtp_model
from moemesh.engine.runner.hidden_states import TargetHiddenStates
from moemesh.engine.runner.model_runner import bind_kv_caches, measure_cache_budget
from moemesh.engine.speculative.proposer import DraftProposal

_BLOCK_SIZE = 16


@dataclass
class _MtpState:
    base: int = 0  # position of cache entry 0
    num_cached: int = 0  # entries computed from the target's hidden states (positions base ..)
    blocks: list[KVCacheBlock] = field(default_factory=list)
    pending: list[TargetHiddenStates] = field(default_factory=list)  # not fed yet, in arrival order


@dataclass
class _Chunk:
    """What one forward feeds a request: pairs (hidden h_p, token t_{p+1}) at positions p."""

    start: int  # position of the first pair
    token_ids: list[int]
    hidden_states: torch.Tensor  # [len(token_ids), hidden]


class MtpProposer:
    def __init__(
        self,
        mtp: nn.Module,
        target: nn.Module,
        device: str,
        dtype: str,
        num_blocks: int,
        block_size: int = _BLOCK_SIZE,
        max_num_batched_tokens: int = 2048,
    ):
        """`mtp`: a DeepseekMTP; `target`: the main model, whose embedding and LM head it shares."""
        self.mtp, self.target = mtp, target
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens  # per catch-up forward (whole requests)
        self.max_len = mtp.cfg.max_position
        bind_kv_caches(mtp, num_blocks, block_size, DTYPES[dtype], self.device)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.states: dict[str, _MtpState] = {}

    # -- queries (tests, stats) --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def cached_window(self, request_id: str) -> tuple[int, int]:
        """(first position, number of positions) of the request's exact MTP cache entries."""
        state = self.states.get(request_id)
        return (state.base, state.num_cached) if state else (0, 0)

    # -- the engine's hooks --------------------------------------------------------------------
    def observe(self, hidden_states: dict[str, TargetHiddenStates]) -> None:
        """After each round: queue the target's hidden states of every scheduled request."""
        for request_id, rows in hidden_states.items():
            self.states.setdefault(request_id, _MtpState()).pending.append(rows)

    @torch.inference_mode()
    def propose(
        self, token_ids: dict[str, list[int]], max_num_tokens: int, keep: Collection[str] = ()
    ) -> dict[str, DraftProposal]:
        """Drafts for every request of `token_ids`; the state of requests in neither `token_ids`
        nor `keep` (requests still prefilling) is freed."""
        for request_id in [r for r in self.states if r not in token_ids and r not in keep]:
            self.free(request_id)
        plans: dict[str, int] = {}  # request id -> drafts to make
        chunks: dict[str, _Chunk] = {}
        for request_id, tokens in token_ids.items():
            k = min(max_num_tokens, self.max_len - len(tokens) + 2)  # last fed position n + k - 3 < max_len
            chunk = self._prepare(request_id, tokens, k) if k > 0 else None
            if chunk is not None:
                plans[request_id], chunks[request_id] = k, chunk
        if not plans:
            return {}
        drafts: dict[str, list[int]] = {r: [] for r in plans}
        confidences: dict[str, list[float]] = {r: [] for r in plans}
        last_hidden: dict[str, torch.Tensor] = {}  # [hidden], the MTP output at each request's last position
        for group in self._catch_up_groups([chunks[r] for r in plans], list(plans)):
            self._append_drafts(group, [chunks[r] for r in group], drafts, confidences, last_hidden)
        for request_id in plans:
            state = self.states[request_id]
            state.num_cached = len(token_ids[request_id]) - 1 - state.base
        for j in range(1, max(plans.values())):
            group = [r for r, k in plans.items() if k > j]
            steps = [_Chunk(len(token_ids[r]) - 2 + j, [drafts[r][-1]], last_hidden[r][None]) for r in group]
            self._append_drafts(group, steps, drafts, confidences, last_hidden)
        return {r: DraftProposal(drafts[r], confidences[r]) for r in plans}

    def free(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None and state.blocks:
            self.pool.free_blocks(reversed(state.blocks))

    # -- internals ---------------------------------------------------------------------------
    def _prepare(self, request_id: str, tokens: list[int], k: int) -> _Chunk | None:
        """The pairs to feed so the cache reaches position n - 2 (at least one, to have the
        output there), with blocks for them and k - 1 drafts. None when the target's hidden
        states of position n - 2 are missing, or the pool is out of blocks."""
        state = self.states.setdefault(request_id, _MtpState())
        end = len(tokens) - 1  # pairs at positions < end exist
        lo = min(state.base + state.num_cached, end - 1)  # re-feed the last pair if there is nothing new
        first, rows = _gather(state.pending, lo, end)
        if rows is None:
            return None
        if first != lo or lo < state.base:  # a gap: restart the window where the hidden states begin
            self._reset(state, first)
        num_required = -(-(end - state.base + k - 1) // self.block_size)
        if num_required < len(state.blocks):
            extra = state.blocks[num_required:]
            del state.blocks[num_required:]
            self.pool.free_blocks(reversed(extra))
        num_new = num_required - len(state.blocks)
        if num_new > self.pool.num_free_blocks:
            return None  # the queued rows stay for a later round
        state.blocks.extend(self.pool.get_new_blocks(num_new))
        state.num_cached = first - state.base
        state.pending = [TargetHiddenStates(end - 1, rows[-1:].clone())]  # kept for a re-feed; drafts' rows dropped
        return _Chunk(first, tokens[first + 1 : end + 1], rows)

    def _reset(self, state: _MtpState, base: int) -> None:
        if state.blocks:
            self.pool.free_blocks(reversed(state.blocks))
        state.blocks, state.base, state.num_cached = [], base, 0

    def _catch_up_groups(self, chunks: list[_Chunk], request_ids: list[str]) -> list[list[str]]:
        """Whole requests per catch-up forward, at most max_num_batched_tokens each (one longer
        request goes alone)."""
        groups: list[list[str]] = [[]]
        num_tokens = 0
        for request_id, chunk in zip(request_ids, chunks):
            n = len(chunk.token_ids)
            if groups[-1] and num_tokens + n > self.max_num_batched_tokens:
                groups.append([])
                num_tokens = 0
            groups[-1].append(request_id)
            num_tokens += n
        return groups

    def _append_drafts(self, request_ids: list[str], chunks: list[_Chunk], drafts, confidences, last_hidden) -> None:
        """Feed each request its chunk; append the argmax after its last pair."""
        hidden, probs = self._forward(request_ids, chunks)  # [num_reqs, hidden], [num_reqs, vocab]
        best_probs, best_ids = probs.max(dim=-1)
        for i, (request_id, token_id, prob) in enumerate(zip(request_ids, best_ids.tolist(), best_probs.tolist())):
            drafts[request_id].append(token_id)
            confidences[request_id].append(prob)
            last_hidden[request_id] = hidden[i]

    def _forward(self, request_ids: list[str], chunks: list[_Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One varlen forward (single-pair chunks first). Returns, in the given order, the MTP
        output at each request's last pair and the next-token probabilities there."""
        order = sorted(range(len(request_ids)), key=lambda i: len(chunks[i].token_ids) != 1)
        states = [self.states[request_ids[i]] for i in order]
        num_new = np.array([len(chunks[i].token_ids) for i in order], dtype=np.int64)  # [num_reqs]
        starts = np.array([chunks[i].start - s.base for i, s in zip(order, states)], dtype=np.int64)  # cache index
        cu = np.zeros(len(order) + 1, dtype=np.int64)  # [num_reqs + 1]
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        token_ids = np.fromiter((t for i in order for t in chunks[i].token_ids), np.int64, total)  # [num_tokens]
        req_index = np.repeat(np.arange(len(order)), num_new)  # [num_tokens]
        index = np.arange(total) - np.repeat(cu[:-1], num_new) + np.repeat(starts, num_new)  # cache index [num_tokens]
        positions = index + np.repeat([s.base for s in states], num_new)  # [num_tokens]
        max_blocks = max(len(s.blocks) for s in states)
        block_tables = np.zeros((len(order), max_blocks), dtype=np.int64)  # [num_reqs, max_blocks], null pads
        for row, state in enumerate(states):
            block_tables[row, : len(state.blocks)] = [b.block_id for b in state.blocks]
        slot_mapping = block_tables[req_index, index // self.block_size] * self.block_size
        slot_mapping += index % self.block_size  # [num_tokens]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            context_lens=self._tensor(starts + num_new, torch.int32),
            block_tables=self._tensor(block_tables, torch.int32),
            num_decode_reqs=int(np.count_nonzero(num_new == 1)),
        )
        embed_weight = self.target.get_parameter("model.embed_tokens.weight")
        embeds = F.embedding(self._tensor(token_ids), embed_weight)  # [num_tokens, hidden]
        prev = torch.cat([chunks[i].hidden_states for i in order]).to(embeds.dtype)  # [num_tokens, hidden]
        out = self.mtp(embeds, prev, self._tensor(positions), meta)  # [num_tokens, hidden]
        last = out[self._tensor(cu[1:] - 1)]  # [num_reqs, hidden]
        probs = torch.softmax(self.target.compute_logits(last).float(), dim=-1)  # [num_reqs, vocab]
        inverse = self._tensor(np.argsort(np.array(order, dtype=np.int64)))
        return last[inverse], probs[inverse]

    def _tensor(self, array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.asarray(array)).to(device=self.device, dtype=dtype)


def _gather(pending: list[TargetHiddenStates], lo: int, end: int) -> tuple[int, torch.Tensor | None]:
    """Rows for positions [first, end) from the queued hidden states (later arrivals win): first
    is lo, or later where positions are missing. (end, None) when position end - 1 is missing."""
    if end <= lo or not pending:
        return end, None
    covered = np.zeros(end - lo, dtype=bool)
    sources: list[tuple[int, int, int, torch.Tensor]] = []  # (from, to, row offset, rows)
    for rows in pending:
        a, b = max(rows.start, lo), min(rows.start + rows.hidden_states.shape[0], end)
        if a < b:
            covered[a - lo : b - lo] = True
            sources.append((a, b, a - rows.start, rows.hidden_states))
    if not covered[-1]:
        return end, None
    missing = np.nonzero(~covered)[0]
    first = lo + (int(missing[-1]) + 1 if len(missing) else 0)
    out = sources[-1][3].new_empty(end - first, sources[-1][3].shape[-1])  # [end - first, hidden]
    for a, b, offset, rows in sources:
        a2 = max(a, first)
        if a2 < b:
            out[a2 - first : b - first] = rows[offset + a2 - a : offset + b - a]
    return first, out


def load_mtp_proposer(spec: SpecConfig, target_config: ModelConfig, target: nn.Module) -> MtpProposer:
    """The target checkpoint's MTP layer on the target's device, in its dtype, with its own KV
    cache of `spec.draft_kv_memory_gib` (called once by SpecDecoder at start-up). Raises
    ConfigError when the model has no MTP layer."""
    checkpoint = open_checkpoint(target_config.model)
    mtp = build_mtp_model(checkpoint, target_config.dtype, target_config.device)
    budget = measure_cache_budget(mtp, target_config, CacheConfig(_BLOCK_SIZE, memory_gib=spec.draft_kv_memory_gib))
    return MtpProposer(mtp, target, target_config.device, target_config.dtype, budget.num_blocks, _BLOCK_SIZE)
