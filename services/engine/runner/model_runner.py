"""Runs one round: flatten the scheduled requests into one varlen batch, run the model once,
sample every request that reached the end of its known tokens in one vectorized call.

Batch order: requests with one query token (decode) first, then prefill chunks. The runner keeps
its own copy of each request (token ids, block ids) updated from the scheduler's deltas and the
tokens it samples.

Ping-pong micro-batch overlap (`ModelConfig.micro_batch_overlap`; by default, when the MoE
model's experts run remotely, on for the round shapes where `overlap_tuner.py` measures it
faster than one batch): a round of >= 2 requests is cut into two runs of whole requests,
A = the first k in batch order, B = the rest, with about equal tokens, each with attention
metadata of its own; the model interleaves them (models/decoder_model.py) and the hidden states
come back in batch order. Per layer A's attention runs before B's, so a request of B may read KV
that a request of A writes in the same round (a prefix hit on blocks being filled), never the
other way round: `micro_batch_split` only cuts where no request of A reads a block B writes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from moemesh.engine.config import CacheBudget, CacheConfig, ModelConfig
from moemesh.engine.core.request import Logprob
from moemesh.engine.core.scheduler_output import SchedulerOutput
from moemesh.engine.layers.attention_metadata import AttentionMetadata
from moemesh.engine.loader.build import DTYPES
from moemesh.engine.models.decoder_model import MicroBatch
from moemesh.engine.runner.hidden_states import TargetHiddenStates
from moemesh.engine.runner.logits_processors import LogitsAdjustments
from moemesh.engine.runner.overlap_tuner import OverlapTuner, round_shape
from moemesh.engine.runner.rejection_sampler import verify_drafts
from moemesh.engine.runner.sampler import Sampler, SamplingTensors
from moemesh.engine.runner.structured_output import NullStructuredOutputs
from moemesh.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (the penalties read it)
    eos_token_id: int | None = None  # masked while min_tokens is not reached


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # with speculation, several
    logprobs: dict[str, Logprob] = field(default_factory=dict)
    # per scheduled request, only when `ModelRunner.keep_hidden_states` (an MTP proposer reads them)
    hidden_states: dict[str, TargetHiddenStates] = field(default_factory=dict)


def bind_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
    """Give every attention layer of `model` its own zeroed paged KV cache (the runner's, and the
    private caches of the draft and MTP proposers)."""
    for attn in model.attention_layers():
        shapes = attn.kv_cache_shape(num_blocks, block_size)
        attn.bind_kv_cache([torch.zeros(shape, dtype=dtype, device=device) for shape in shapes])


def micro_batch_split(
    num_new: np.ndarray,  # [num_reqs] query tokens per request, in batch order
    context_lens: np.ndarray,  # [num_reqs] cached + new tokens
    block_tables: np.ndarray,  # [num_reqs, max_num_blocks]
    slot_mapping: np.ndarray,  # [num_tokens]
    block_size: int,
) -> int | None:
    """k such that requests [0, k) and [k, num_reqs) are the two micro-batches: the most even
    split in tokens among those where no request before k reads a block that a request from k on
    writes this round. None: no such split (or one request): run the round whole."""
    num_reqs = len(num_new)
    if num_reqs < 2:
        return None
    written = slot_mapping // block_size  # [num_tokens] block of each new token
    written, first = np.unique(written, return_index=True)  # a block is written by one request
    writer = np.repeat(np.arange(num_reqs), num_new)[first]  # [num_written_blocks]
    num_read = -(-context_lens // block_size)  # [num_reqs] blocks each request's attention reads
    mask = np.arange(block_tables.shape[1])[None, :] < num_read[:, None]
    reader, read = np.nonzero(mask)[0], block_tables[mask]  # [num_reads]
    at = np.minimum(np.searchsorted(written, read), len(written) - 1)
    later = (written[at] == read) & (writer[at] > reader)  # read here, written by a later request
    # a cut k with reader < k <= writer would run the read before the write
    cuts_broken = np.zeros(num_reqs + 2, dtype=np.int64)
    np.add.at(cuts_broken, reader[later] + 1, 1)
    np.add.at(cuts_broken, writer[at][later] + 1, -1)
    valid = np.cumsum(cuts_broken)[1:num_reqs] == 0  # cuts k = 1 .. num_reqs - 1
    if not valid.any():
        return None
    cu = np.cumsum(num_new)[:-1]  # [num_reqs - 1] tokens before each cut
    imbalance = np.where(valid, np.abs(2 * cu - int(num_new.sum())), np.iinfo(np.int64).max)
    return 1 + int(np.argmin(imbalance))


def measure_cache_budget(model: nn.Module, model_config: ModelConfig, cache_config: CacheConfig) -> CacheBudget:
    elem = torch.empty((), dtype=DTYPES[model_config.dtype]).element_size()
    shapes = [s for attn in model.attention_layers() for s in attn.kv_cache_shape(1, cache_config.block_size)]
    bytes_per_block = sum(torch.Size(shape).numel() for shape in shapes) * elem  # all layers, all cache tensors
    num_blocks = cache_config.num_blocks or max(2, int(cache_config.memory_gib * 2**30) // bytes_per_block)
    return CacheBudget(num_blocks=num_blocks, block_size=cache_config.block_size, bytes_per_block=bytes_per_block)


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, budget: CacheBudget):
        self.model = model
        self.device = torch.device(model_config.device)
        self.block_size = budget.block_size
        bind_kv_caches(model, budget.num_blocks, budget.block_size, DTYPES[model_config.dtype], self.device)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(model_config.seed))
        self.requests: dict[str, CachedRequestState] = {}
        self.keep_hidden_states = False  # set by the engine when its proposer drafts from them
        self.structured_outputs = NullStructuredOutputs()  # the engine installs xgrammar's when it has a tokenizer
        self.micro_batch_overlap = model_config.micro_batch_overlap  # None: remote experts, where it pays
        self.overlap_tuner = OverlapTuner()  # what "where it pays" means: measured per round shape

    # -- state updates from the scheduler ------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_req_ids:
            self.requests.pop(request_id, None)
            self.structured_outputs.remove(request_id)
        for new in out.scheduled_new_reqs:
            spec = new.sampling_params.structured_output
            if spec is not None:  # resumed, or after a remote prefill: continue from its outputs
                self.structured_outputs.add(
                    new.request_id, spec, new.token_ids[len(new.token_ids) - new.num_output_tokens :]
                )
            generator = self._request_generator(new.sampling_params, new.num_output_tokens)
            self.requests[new.request_id] = CachedRequestState(
                new.request_id,
                list(new.token_ids),
                new.sampling_params,
                list(new.block_ids),
                new.num_computed_tokens,
                generator,
                len(new.token_ids) - new.num_output_tokens,
                new.eos_token_id,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _request_generator(self, params: SamplingParams, num_sampled: int) -> torch.Generator | None:
        """A seeded request's generator, fast-forwarded past the draws of the `num_sampled`
        tokens it already has (each sampled token draws one Exp(1) per vocabulary entry), so a
        request resumed after preemption, or decoding after a remote prefill, continues the
        stream of the seed instead of restarting it."""
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if num_sampled and not params.greedy:
            torch.empty(num_sampled, self.model.cfg.vocab_size, device=self.device).exponential_(generator=generator)
        return generator

    # -- one round -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        order = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        num_new = np.array([out.num_scheduled_tokens[r] for r in order], dtype=np.int64)  # [num_reqs]
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)  # [num_reqs]
        cu = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])

        spec = out.scheduled_spec_token_ids  # drafts follow the request's known tokens
        num_spec = np.array([len(spec.get(r, ())) for r in order], dtype=np.int64)  # [num_reqs]
        seqs = [s.token_ids + spec[r] if r in spec else s.token_ids for r, s in zip(order, states)]
        token_ids = np.fromiter(
            (t for seq, a, n in zip(seqs, starts, num_new) for t in seq[a : a + n]), np.int64, total
        )  # [num_tokens]
        req_index = np.repeat(np.arange(len(order)), num_new)  # [num_tokens]
        positions = np.arange(total) - np.repeat(cu[:-1], num_new) + np.repeat(starts, num_new)  # [num_tokens]
        context_lens = starts + num_new  # [num_reqs]
        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = np.zeros((len(order), max_blocks), dtype=np.int64)  # null block pads
        for i, s in enumerate(states):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slot_mapping = block_tables[req_index, positions // self.block_size] * self.block_size
        slot_mapping += positions % self.block_size  # [num_tokens]

        reaches_end = context_lens == np.array([len(seq) for seq in seqs])
        plain_rows = np.nonzero(reaches_end & (num_spec == 0))[0]
        spec_rows = np.nonzero(num_spec > 0)[0]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping),
            cu_seqlens_q=self._tensor(cu, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            block_tables=self._tensor(block_tables, torch.int32),
            num_decode_reqs=int(np.count_nonzero(num_new == 1)),
        )
        split, timed = None, None
        overlap = self._overlap_micro_batches()
        if overlap is not False:
            split = micro_batch_split(num_new, context_lens, block_tables, slot_mapping, self.block_size)
        if split is not None and overlap is self.overlap_tuner:
            shape = round_shape(total, meta.num_decode_reqs == len(order))
            if not self.overlap_tuner.use_overlap(shape):
                split = None
            timed = shape if self.overlap_tuner.measuring(shape) else None
        started = self.overlap_tuner.clock()
        if split is None:
            hidden = self.model(self._tensor(token_ids), self._tensor(positions), meta)  # [num_tokens, hidden]
        else:
            hidden = self._forward_micro_batches(split, token_ids, positions, cu, meta)  # [num_tokens, hidden]
        if timed is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.overlap_tuner.record(timed, split is not None, self.overlap_tuner.clock() - started)
        for state, n in zip(states, num_new):
            state.num_computed_tokens += int(n)
        output = ModelRunnerOutput()
        if self.keep_hidden_states:
            output.hidden_states = {
                r: TargetHiddenStates(int(a), hidden[int(b) : int(c)])
                for r, a, b, c in zip(order, starts, cu[:-1], cu[1:])
            }
        if len(plain_rows):
            logits = self.model.compute_logits(
                hidden[self._tensor(cu[1:][plain_rows] - 1)]
            ).float()  # [num_plain, vocab]
            plain_states = [states[i] for i in plain_rows]
            self.structured_outputs.apply_bitmask(logits, [s.request_id for s in plain_states])
            self._collect(plain_states, self.sampler(logits, self._sampling_tensors(plain_states)), output)
        if len(spec_rows):
            self._verify(
                [states[i] for i in spec_rows], [spec[order[i]] for i in spec_rows], hidden, cu[1:][spec_rows], output
            )
        return output

    def _overlap_micro_batches(self) -> bool | OverlapTuner:
        """False / True: never / always split; the tuner: auto with remote experts (it decides)."""
        if not hasattr(self.model, "forward_micro_batches"):  # a dense model: nothing to overlap
            return False
        if self.micro_batch_overlap is None:
            return self.overlap_tuner if self.model.experts_overlap_submit else False
        return self.micro_batch_overlap

    def _forward_micro_batches(self, k: int, token_ids, positions, cu: np.ndarray, meta: AttentionMetadata):
        """Requests [0, k) and [k, num_reqs) as two micro-batches; hidden states in batch order."""
        ids, pos = self._tensor(token_ids), self._tensor(positions)  # [num_tokens]
        c = int(cu[k])
        num_decode_a = min(k, meta.num_decode_reqs)
        halves = [
            MicroBatch(
                ids[:c],
                pos[:c],
                AttentionMetadata(
                    slot_mapping=meta.slot_mapping[:c],
                    cu_seqlens_q=meta.cu_seqlens_q[: k + 1],
                    context_lens=meta.context_lens[:k],
                    block_tables=meta.block_tables[:k],
                    num_decode_reqs=num_decode_a,
                ),
            ),
            MicroBatch(
                ids[c:],
                pos[c:],
                AttentionMetadata(
                    slot_mapping=meta.slot_mapping[c:],
                    cu_seqlens_q=self._tensor(cu[k:] - c, torch.int32),
                    context_lens=meta.context_lens[k:],
                    block_tables=meta.block_tables[k:],
                    num_decode_reqs=meta.num_decode_reqs - num_decode_a,
                ),
            ),
        ]
        return torch.cat(self.model.forward_micro_batches(halves))  # [num_tokens, hidden]

    def _verify(self, states, drafts: list[list[int]], hidden, ends: np.ndarray, output: ModelRunnerOutput) -> None:
        """Logits at each spec request's last token and its drafts, then lossless verification."""
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        max_k = int(num_drafts.max())
        # row r, position j (0..max_k) -> flattened token index, clamped inside the row's chunk
        j = np.arange(max_k + 1)[None, :]
        index = ends[:, None] - 1 - num_drafts[:, None] + np.minimum(j, num_drafts[:, None])
        logits = self.model.compute_logits(hidden[self._tensor(index.reshape(-1))]).float()  # [R * (k+1), vocab]
        t = self._sampling_tensors(states).repeat_rows(max_k + 1)
        probs = self.sampler.probs(logits, t).view(len(states), max_k + 1, -1)  # [R, k + 1, vocab]
        draft_ids = np.zeros((len(states), max_k), dtype=np.int64)
        for r, d in enumerate(drafts):
            draft_ids[r, : len(d)] = d
        greedy = torch.tensor([s.sampling_params.greedy for s in states], device=self.device)
        result = verify_drafts(
            probs, self._tensor(draft_ids), self._tensor(num_drafts), greedy, generator=self.sampler.generator
        )
        for state, token_ids, k in zip(states, result.token_ids, num_drafts):
            state.token_ids.extend(token_ids)
            state.num_computed_tokens -= int(k) - (len(token_ids) - 1)  # rejected drafts' KV is stale
            output.sampled_token_ids[state.request_id] = token_ids

    @torch.inference_mode()
    def measure_step_seconds(self, token_counts: list[int], repeats: int = 3) -> list[float]:
        """Seconds per forward for decode-shaped rounds of each token count (the DSpark cost
        table). Dummy tokens write only into the null block, which no request reads."""
        seconds = []
        for n in token_counts:
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(n, dtype=torch.int64, device=self.device),
                cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=self.device),
                context_lens=torch.ones(n, dtype=torch.int32, device=self.device),
                block_tables=torch.zeros(n, 1, dtype=torch.int32, device=self.device),
                num_decode_reqs=n,
            )
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            self.model.compute_logits(self.model(ids, ids, meta))  # warm-up
            times = []
            for _ in range(repeats):
                meta.derived.clear()  # a real round builds its decode plan and RoPE gather too
                start = time.perf_counter()
                self.model.compute_logits(self.model(ids, ids, meta))
                times.append(time.perf_counter() - start)
            seconds.append(min(times))  # the least disturbed run
        return seconds

    def _collect(self, states: list[CachedRequestState], result, output: ModelRunnerOutput) -> None:
        token_ids = result.token_ids.tolist()
        lp = lp_ids = None
        if result.logprobs is not None:
            lp, lp_ids = result.logprobs.tolist(), result.logprob_token_ids.tolist()
        for i, (state, token_id) in enumerate(zip(states, token_ids)):
            state.token_ids.append(token_id)
            output.sampled_token_ids[state.request_id] = [token_id]
            self.structured_outputs.accept(state.request_id, token_id)
            n = state.sampling_params.logprobs
            if n is not None:
                top = dict(zip(lp_ids[i][1 : 1 + n], lp[i][1 : 1 + n]))
                output.logprobs[state.request_id] = Logprob(token_id, lp[i][0], top)

    def _sampling_tensors(self, states: list[CachedRequestState]) -> SamplingTensors:
        params = [s.sampling_params for s in states]
        temperature = [0.0 if p.greedy else p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        sampled = [p for p in params if not p.greedy]
        return SamplingTensors(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=self.device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=self.device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=self.device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=self.device),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            all_greedy=not sampled,
            need_top_k=any(p.top_k > 0 for p in sampled),
            need_top_p=any(p.top_p < 1 for p in sampled),
            need_min_p=any(p.min_p > 0 for p in sampled),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            adjustments=LogitsAdjustments.build(states, self.model.cfg.vocab_size, self.device),
        )

    def _tensor(self, array: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        return torch.from_numpy(array).to(device=self.device, dtype=dtype)
