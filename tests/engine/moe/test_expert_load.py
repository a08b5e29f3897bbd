"""Per-(MoE layer, logical expert) token counters over a sliding window of steps."""

from __future__ import annotations

import pytest
import torch

from moemesh import LLM, SamplingParams
from moemesh.engine.layers.expert_load_counter import ExpertLoadCounter

from .models import build_mixtral, make_prompts, save_tiny


def ids(*rows: list[int]) -> torch.Tensor:  # [num_tokens, top_k]
    return torch.tensor(rows, dtype=torch.int64)


def test_a_crafted_step_gives_exact_counts_per_layer_and_expert():
    counter = ExpertLoadCounter(num_layers=2, num_experts=4)
    counter.begin_step()
    counter.record(0, ids([0, 1], [1, 3], [1, 0]))
    counter.record(1, ids([2, 2], [3, 0]))  # a repeated id counts twice
    assert counter.counts().tolist() == [[2, 3, 0, 1], [1, 0, 2, 1]]
    assert counter.counts().dtype == torch.int64


def test_the_window_slides_and_the_oldest_steps_drop_out():
    counter = ExpertLoadCounter(num_layers=1, num_experts=5, num_buckets=3, steps_per_bucket=1)
    for step in range(5):  # step s routes one token to expert s, s + 1 tokens of it
        counter.begin_step()
        counter.record(0, ids(*[[step]] * (step + 1)))
        if step == 2:
            assert counter.counts().tolist() == [[1, 2, 3, 0, 0]]
    assert counter.counts().tolist() == [[0, 0, 3, 4, 5]]  # steps 0 and 1 left the window
    assert counter.num_steps == 5 and counter.window_steps == 3


def test_buckets_of_several_steps_drop_out_together():
    counter = ExpertLoadCounter(num_layers=1, num_experts=2, num_buckets=2, steps_per_bucket=2)
    for _ in range(4):  # buckets [s0, s1] [s2, s3]
        counter.begin_step()
        counter.record(0, ids([0]))
    assert counter.counts().tolist() == [[4, 0]]
    counter.begin_step()  # s4 reuses the bucket of s0 and s1
    counter.record(0, ids([1]))
    assert counter.counts().tolist() == [[2, 1]]
    counter.reset()
    assert counter.counts().tolist() == [[0, 0]] and counter.num_steps == 0


def test_counts_are_zero_before_anything_is_recorded():
    assert ExpertLoadCounter(3, 2).counts().tolist() == [[0, 0]] * 3
    with pytest.raises(ValueError, match="num_buckets"):
        ExpertLoadCounter(1, 2, num_buckets=0)


def test_the_engine_counts_top_k_experts_for_every_token_it_runs(tmp_path):
    save_tiny(build_mixtral, str(tmp_path))
    llm = LLM(str(tmp_path), block_size=4, num_blocks=64, enable_prefix_caching=False, show_progress=False)
    model = llm.engine.model
    model.expert_load.reset()
    prompts = make_prompts()[:4]
    max_tokens = 5
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    counts = model.expert_load.counts()  # [num_moe_layers, num_experts]
    num_tokens_run = sum(len(p) + max_tokens - 1 for p in prompts)  # the last sampled token is never fed
    assert counts.shape == (2, 8)
    assert counts.sum(dim=1).tolist() == [num_tokens_run * 2] * 2  # top-2 in both MoE layers
    assert model.expert_load.num_steps == 1 + (max_tokens - 1)  # one prefill round, then decodes
    assert (counts > 0).sum() > 8  # routing is spread, not all on one expert
    model.expert_load.reset()  # outside inference mode, after the engine counted inside it
    assert model.expert_load.counts().sum() == 0
