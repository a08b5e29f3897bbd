"""Draft-model proposer: a small model that shares the target's vocabulary drafts k tokens for
every candidate request, in k batched forwards through its own paged KV cache.

Per request it remembers the tokens whose KV is in its cache. Each round (`propose`, called by
`SpecDecoder.prepare` before scheduling):

1. requests that are no longer candidates (finished, aborted, preempted, out of room) are
   forgotten and their blocks freed;
2. each request rolls back to the longest common prefix of its cached tokens and its real tokens,
   so the KV of rejected drafts is overwritten, and catches up on the rest in one varlen forward
   over all requests; the logits at each request's last token give draft 1;
3. k - 1 more forwards, one token per request, give drafts 2..k (a request near the draft's
   context limit drops out early).

Drafts are the draft model's argmax, proposed as point masses (`draft_probs` None): greedy
requests accept a draft exactly when the target's argmax agrees, sampled requests go through
rejection sampling against a point mass; both are lossless. The confidence of a draft is the draft
model's probability of it (the DSpark scheduler's input).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from moemesh.engine.config import CacheConfig, ModelConfig, SpecConfig
from moemesh.engine.core.block_pool import BlockPool, KVCacheBlock
from moemesh.engine.dtype import resolve_dtype
from moemesh.engine.errors import ConfigError, ModelLoadError
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.layers.transformer_config import TransformerConfig
from moemesh.engine.loader import open_checkpoint
from moemesh.engine.loader.build import DTYPES, build_model
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.engine.runner.model_runner import bind_kv_caches, measure_cache_budget
from moemesh.engine.speculative.proposer import DraftProposal

_LAYER_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_BLOCK_SIZE = 16


@dataclass
class _DraftState:
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is at positions 0..len-1
    blocks: list[KVCacheBlock] = field(default_factory=list)


class DraftModelProposer:
    def __init__(
        self,
        model: nn.Module,
        device: str,
        dtype: str,
        num_blocks: int,
        block_size: int = _BLOCK_SIZE,
        max_num_batched_tokens: int = 2048,
    ):
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens  # per catch-up forward (whole requests)
        self.max_len = model.cfg.max_position
        bind_kv_caches(model, num_blocks, block_size, DTYPES[dtype], self.device)
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.states: dict[str, _DraftState] = {}

    # -- queries (tests, stats) --------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def cached_token_ids(self, request_id: str) -> list[int]:
        """The tokens whose KV the draft model holds for this request."""
        state = self.states.get(request_id)
        return list(state.token_ids) if state else []

    # -- the proposer interface ------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, token_ids: dict[str, list[int]], max_num_tokens: int) -> dict[str, DraftProposal]:
        """Drafts for every request of `token_ids`; state of requests absent from it is freed."""
        for request_id in [r for r in self.states if r not in token_ids]:
            self.free(request_id)
        plans: dict[str, int] = {}  # request id -> drafts to make
        for request_id, tokens in token_ids.items():
            k = min(max_num_tokens, self.max_len - len(tokens) + 1)  # last fed position < max_len
            if k > 0 and self._prepare(request_id, tokens, k):
                plans[request_id] = k
        if not plans:
            return {}
        drafts: dict[str, list[int]] = {r: [] for r in plans}
        confidences: dict[str, list[float]] = {r: [] for r in plans}
        for group in self._catch_up_groups(plans, token_ids):
            chunks = [token_ids[r][len(self.states[r].token_ids) :] for r in group]
            self._append_drafts(group, chunks, drafts, confidences)
        for j in range(1, max(plans.values())):
            group = [r for r, k in plans.items() if k > j]
            self._append_drafts(group, [[drafts[r][-1]] for r in group], drafts, confidences)
        return {r: DraftProposal(drafts[r], confidences[r]) for r in plans}

    def free(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None and state.blocks:
            self.pool.free_blocks(reversed(state.blocks))

    # -- internals ---------------------------------------------------------------------------
    def _prepare(self, request_id: str, tokens: list[int], k: int) -> bool:
        """Roll the request's cache back to what still matches `tokens` (keeping at least one
        token to feed) and size its blocks for `tokens` plus k - 1 fed drafts. False, drafting
        nothing, when the pool is out of blocks."""
        state = self.states.setdefault(request_id, _DraftState())
        num_common = min(_common_prefix_len(state.token_ids, tokens), len(tokens) - 1)
        del state.token_ids[num_common:]
        num_required = -(-(len(tokens) + k - 1) // self.block_size)
        if num_required < len(state.blocks):
            extra = state.blocks[num_required:]
            del state.blocks[num_required:]
            self.pool.free_blocks(reversed(extra))
        num_new = num_required - len(state.blocks)
        if num_new > self.pool.num_free_blocks:
            return False
        state.blocks.extend(self.pool.get_new_blocks(num_new))
        return True

    def _catch_up_groups(self, plans: dict[str, int], token_ids: dict[str, list[int]]) -> list[list[str]]:
        """Whole requests per catch-up forward, at most max_num_batched_tokens each (one longer
        request goes alone)."""
        groups: list[list[str]] = [[]]
        num_tokens = 0
        for request_id in plans:
            n = len(token_ids[request_id]) - len(self.states[request_id].token_ids)
            if groups[-1] and num_tokens + n > self.max_num_batched_tokens:
                groups.append([])
                num_tokens = 0
            groups[-1].append(request_id)
            num_tokens += n
        return groups

    def _append_drafts(self, request_ids: list[str], chunks: list[list[int]], drafts, confidences) -> None:
        """Feed each request its chunk of new tokens; append the argmax after its last one."""
        probs = self._forward(request_ids, chunks)  # [num_reqs, vocab]
        best_probs, best_ids = probs.max(dim=-1)
        for request_id, token_id, prob in zip(request_ids, best_ids.tolist(), best_probs.tolist()):
            drafts[request_id].append(token_id)
            confidences[request_id].append(prob)

    def _forward(self, request_ids: list[str], chunks: list[list[int]]) -> torch.Tensor:
        """One varlen forward (single-token chunks first); next-token probabilities after each
        request's chunk, in the given order. Extends each request's cached tokens."""
        order = sorted(range(len(request_ids)), key=lambda i: len(chunks[i]) != 1)
        states = [self.states[request_ids[i]] for i in order]
        num_new = np.array([len(chunks[i]) for i in order], dtype=np.int64)  # [num_reqs]
        starts = np.array([len(s.token_ids) for s in states], dtype=np.int64)  # [num_reqs]
        cu = np.zeros(len(order) + 1, dtype=np.int64)  # [num_reqs + 1]
        np.cumsum(num_new, out=cu[1:])
        token_ids = np.fromiter((t for i in order for t in chunks[i]), np.int64, int(cu[-1]))  # [num_tokens]
        req_index = np.repeat(np.arange(len(order)), num_new)  # [num_tokens]
        positions = np.arange(int(cu[-1])) - np.repeat(cu[:-1], num_new) + np.repeat(starts, num_new)  # [num_tokens]
        max_blocks = max(len(s.blocks) for s in states)
        block_tables = np.zeros((len(order), max_blocks), dtype=np.int64)  # [num_reqs, max_blocks], null pads
        for row, state in enumerate(states):
            block_tables[row, : len(state.blocks)] = [b.block_id for b in state.blocks]
        slot_mapping = block_tables[req_index, positions // self.block_size] * self.block_size
        slot_mapping += positions % self.block_size  # [num_tokens]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            context_lens=self._tensor(starts + num_new, torch.int32),
            block_tables=self._tensor(block_tables, torch.int32),
            num_decode_reqs=int(np.count_nonzero(num_new == 1)),
        )
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), meta)  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[self._tensor(cu[1:] - 1)]).float()  # [num_reqs, vocab]
        for state, i in zip(states, order):
            state.token_ids.extend(chunks[i])
        probs = torch.empty_like(logits)
        probs[self._tensor(np.array(order, dtype=np.int64))] = torch.softmax(logits, dim=-1)
        return probs

    def _tensor(self, array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return torch.from_numpy(array).to(device=self.device, dtype=dtype)


def load_draft_proposer(spec: SpecConfig, target: ModelConfig, target_vocab_size: int) -> DraftModelProposer:
    """Load `spec.draft_model` on the target's device (called once by SpecDecoder at start-up).
    Raises ModelLoadError for a missing / unreadable checkpoint and ConfigError when the draft's
    vocabulary differs from the target's or it has fewer than `draft_num_layers` layers."""
    try:
        checkpoint = open_checkpoint(spec.draft_model)
    except ModelLoadError as e:
        raise ModelLoadError(f"draft model: {e}") from e
    vocab_size = TransformerConfig.from_hf(checkpoint.hf_config).vocab_size
    if vocab_size != target_vocab_size:
        raise ConfigError(
            f"draft model {spec.draft_model!r} has a vocabulary of {vocab_size} tokens, the target "
            f"{target_vocab_size}; a draft must share the target's tokenizer"
        )
    if spec.draft_num_layers is not None:
        checkpoint = first_layers(checkpoint, spec.draft_num_layers)
    dtype = resolve_dtype(spec.draft_dtype or target.dtype, target.device)
    model = build_model(checkpoint, dtype, target.device, show_progress=False)
    draft_config = ModelConfig(spec.draft_model, dtype, target.device)
    budget = measure_cache_budget(model, draft_config, CacheConfig(_BLOCK_SIZE, memory_gib=spec.draft_kv_memory_gib))
    return DraftModelProposer(model, target.device, dtype, budget.num_blocks, _BLOCK_SIZE)


def first_layers(checkpoint: Checkpoint, num_layers: int) -> Checkpoint:
    """The checkpoint cut to its first `num_layers` decoder layers (final norm and LM head kept):
    a self-speculative draft of a model, no extra weights needed."""
    total = checkpoint.hf_config["num_hidden_layers"]
    if num_layers > total:
        raise ConfigError(f"draft_num_layers is {num_layers} but the draft model has {total} layers")

    def iter_weights(*args):  # passes a loader's optional arguments (a name filter) through
        for name, tensor in checkpoint.iter_weights(*args):
            match = _LAYER_WEIGHT.search(name)
            if match is None or int(match.group(1)) < num_layers:
                yield name, tensor

    hf_config = {**checkpoint.hf_config, "num_hidden_layers": num_layers}
    return Checkpoint(hf_config, checkpoint.tokenizer, iter_weights, checkpoint.num_tensors, checkpoint.model_id)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    mismatch = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(mismatch[0]) if len(mismatch) else n
