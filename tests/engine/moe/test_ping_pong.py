"""Ping-pong micro-batch overlap: a round split into two micro-batches gives the un-split round's
greedy tokens (and Hugging Face's), float32 logits within 1e-5; the stack really starts micro-batch
B's attention of a MoE layer before it waits on micro-batch A's experts of that layer; the split
never puts a request before a same-round writer of a block it reads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moemesh import LLM, SamplingParams
from moemesh.engine.layers.expert_executor import ExpertHandle, LocalExpertExecutor
from moemesh.engine.runner.model_runner import micro_batch_split
from moemesh.engine.runner.overlap_tuner import OverlapTuner

from ..oracle_helpers import max_rel_error
from .models import BUILDERS, MAX_NEW, hf_greedy, make_prompts, save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def tiny(request, tmp_path_factory):
    """(checkpoint dir, prompts, HF greedy outputs) for one architecture."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny(BUILDERS[request.param], path)
    prompts = make_prompts()
    return path, prompts, [hf_greedy(hf, p) for p in prompts]


def _engine(path: str, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 128, "show_progress": False, "async_scheduling": False} | kw
    return LLM(path, **kw)


def _recording(llm: LLM) -> tuple[list, list]:
    """Wrap the model: every logits tensor computed, and the token counts of every split forward."""
    model, logits, splits = llm.engine.model, [], []
    compute_logits, forward_micro_batches = model.compute_logits, model.forward_micro_batches

    def record_logits(hidden):
        out = compute_logits(hidden)
        logits.append(out.clone())
        return out

    def record_split(batches):
        splits.append([b.input_ids.numel() for b in batches])
        return forward_micro_batches(batches)

    model.compute_logits, model.forward_micro_batches = record_logits, record_split
    return logits, splits


def test_split_rounds_match_unsplit_rounds_and_hf_greedy(tiny):
    path, prompts, expected = tiny
    split_llm, whole_llm = _engine(path, micro_batch_overlap=True), _engine(path, micro_batch_overlap=False)
    split_logits, splits = _recording(split_llm)
    whole_logits, no_splits = _recording(whole_llm)
    split_out = [o.token_ids for o in split_llm.generate(prompts, GREEDY)]
    whole_out = [o.token_ids for o in whole_llm.generate(prompts, GREEDY)]
    assert split_out == whole_out == expected
    assert not no_splits
    assert len(splits) >= MAX_NEW  # the prefill round(s) and every decode round of 8 requests
    assert any(sum(s) > 8 for s in splits) and [4, 4] in splits  # prefill rounds and decode rounds
    assert len(split_logits) == len(whole_logits)
    for ours, ref in zip(split_logits, whole_logits):
        assert max_rel_error(ours, ref) < 1e-5


def test_split_is_even_in_tokens_and_never_precedes_a_same_round_writer():
    block_size = 4
    # requests 0..3 in batch order; request 0 (1 query token) reads blocks 8 and 9, which request 2
    # fills this round (a prefix hit on a block being written), so cuts 1 and 2 are not allowed
    num_new = np.array([1, 3, 8, 4])
    context_lens = np.array([9, 3, 8, 4])
    block_tables = np.array([[8, 9, 10], [3, 0, 0], [8, 9, 0], [5, 0, 0]])
    slot_mapping = np.concatenate([[40], [12, 13, 14], np.arange(32, 40), [20, 21, 22, 23]])
    assert micro_batch_split(num_new, context_lens, block_tables, slot_mapping, block_size) == 3
    free = np.array([[6, 7, 10], [3, 0, 0], [8, 9, 0], [5, 0, 0]])  # request 0 reads blocks 6, 7 instead
    assert (
        micro_batch_split(num_new, context_lens, free, slot_mapping, block_size) == 2
    )  # 4 | 12 tokens (as even as 12 | 4; the first wins)
    assert micro_batch_split(num_new[:1], context_lens[:1], block_tables[:1], slot_mapping[:1], block_size) is None
    # request 0 reads what the last request writes: no cut is allowed at all
    last_writes = np.array([[5, 9, 10], [3, 0, 0], [8, 9, 0], [5, 0, 0]])
    assert micro_batch_split(num_new, context_lens, last_writes, slot_mapping, block_size) is None


class _Gated(ExpertHandle):
    def __init__(self, layer: int, output):
        self.layer, self.output, self.released, self.gated = layer, output, threading.Event(), False


class GatedExecutor(LocalExpertExecutor):
    """Local experts whose result a `wait` may only take once another micro-batch's attention of
    the same MoE layer has run (`release`, from an attention pre-hook; a submit while the same
    layer is in flight is micro-batch B's and is not gated): with `block` a wait
    blocks until then (a deadlock without overlap, so bounded by a timeout), without it a wait
    records whether it was released. `forward` = wait(submit), as a remote executor's."""

    overlaps_submit = True  # auto mode turns ping-pong on, as for remote experts

    def __init__(self, experts, block: bool):
        super().__init__(experts)
        self.block, self.in_flight, self.released = block, [], []

    def submit(self, layer, hidden_states, topk_ids, topk_weights):
        handle = _Gated(layer, super().forward(layer, hidden_states, topk_ids, topk_weights))
        if any(h.layer == layer for h in self.in_flight):  # micro-batch B of this layer: not gated
            handle.released.set()
        else:
            handle.gated = True
        self.in_flight.append(handle)
        return handle

    def release(self, layer: int) -> None:
        for handle in self.in_flight:
            if handle.layer == layer:
                handle.released.set()

    def wait(self, handle):
        self.in_flight.remove(handle)
        if handle.gated:
            self.released.append(handle.released.wait(timeout=60) if self.block else handle.released.is_set())
        return handle.output

    def forward(self, layer, hidden_states, topk_ids, topk_weights):
        return self.wait(self.submit(layer, hidden_states, topk_ids, topk_weights))


def _gated_engine(path: str, block: bool, **kw) -> tuple[LLM, GatedExecutor]:
    llm = _engine(path, **kw)
    model = llm.engine.model
    executor = GatedExecutor([moe.experts for moe in model.moe_layers()], block)
    model.set_expert_executor(executor)
    for ordinal, index in enumerate(model.moe_layer_ids):
        model.model.layers[index].self_attn.register_forward_pre_hook(
            lambda module, args, ordinal=ordinal: executor.release(ordinal)
        )
    return llm, executor


def test_attention_of_micro_batch_b_runs_before_the_wait_on_a_in_every_moe_layer(tiny):
    path, prompts, expected = tiny
    llm, executor = _gated_engine(path, block=True, micro_batch_overlap=True)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    num_moe_layers = len(llm.engine.model.moe_layer_ids)
    assert len(executor.released) >= MAX_NEW * num_moe_layers  # micro-batch A of every MoE layer and round
    assert not executor.released.count(False), "a wait on micro-batch A came before B's attention"
    assert not executor.in_flight


def test_without_overlap_every_wait_comes_before_any_other_attention(tiny):
    path, prompts, expected = tiny
    llm, executor = _gated_engine(path, block=False, micro_batch_overlap=False)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert executor.released and not any(executor.released)  # the blocking fake would deadlock here


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedExecutor(LocalExpertExecutor):
    """Local experts that cost time on a fake clock, like remote ones: each submit costs
    `submit_s` (the transport's fixed cost per call), and a call's result is ready
    `per_token_s` x its tokens after its submit (the expert side computing while the caller goes
    on); each attention call costs `per_token_s` x its tokens (a pre-hook)."""

    overlaps_submit = True

    def __init__(self, experts, clock: FakeClock, submit_s: float, per_token_s: float):
        super().__init__(experts)
        self.clock, self.submit_s, self.per_token_s = clock, submit_s, per_token_s

    def submit(self, layer, hidden_states, topk_ids, topk_weights):
        self.clock.now += self.submit_s
        handle = _Gated(layer, super().forward(layer, hidden_states, topk_ids, topk_weights))
        handle.ready_at = self.clock.now + self.per_token_s * hidden_states.shape[0]
        return handle

    def wait(self, handle):
        self.clock.now = max(self.clock.now, handle.ready_at)
        return handle.output

    def forward(self, layer, hidden_states, topk_ids, topk_weights):
        return self.wait(self.submit(layer, hidden_states, topk_ids, topk_weights))


@pytest.mark.parametrize("submit_s, overlap_pays", [(0.0, True), (0.05, False)])
def test_auto_keeps_ping_pong_only_for_round_shapes_where_it_measures_faster(tiny, submit_s, overlap_pays):
    """Attention as costly as the experts and no fixed cost per call: one micro-batch's attention
    hides the other's experts (1.5 x vs 2 x the attention). A fixed cost per call far above the
    compute: two micro-batches pay it twice per layer and lose."""
    path, prompts, expected = tiny
    llm = _engine(path)  # micro_batch_overlap None: auto
    clock, runner = FakeClock(), llm.engine.runner
    runner.overlap_tuner = OverlapTuner(num_trials=2, reprobe_every=1000, clock=clock)
    model = llm.engine.model
    executor = CostedExecutor([moe.experts for moe in model.moe_layers()], clock, submit_s, per_token_s=0.001)
    model.set_expert_executor(executor)
    for index in model.moe_layer_ids:
        model.model.layers[index].self_attn.register_forward_pre_hook(
            lambda module, args: setattr(clock, "now", clock.now + 0.001 * args[0].numel())
        )
    _, splits = _recording(llm)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    decode = (True, 3)  # the rounds where all 8 requests decode
    assert runner.overlap_tuner.chosen()[decode] is overlap_pays
    num_decode_splits = sum(1 for s in splits if s == [4, 4])
    if overlap_pays:
        assert num_decode_splits >= MAX_NEW - 1 - 2  # every decode round but the two measured whole
    else:
        assert num_decode_splits == 2  # the measured rounds only
