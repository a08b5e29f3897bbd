"""Sampling on the real model: seeds, greedy equivalences, stop strings; sampler masks in isolation."""

from __future__ import annotations

import pytest
import torch

from moemesh import SamplingParams
from moemesh.engine.runner.sampler import Sampler, SamplingTensors

PROMPTS = ["Once upon a time", "The best way to learn programming is", "Paris is"]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(smollm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = smollm.generate(PROMPTS[0], params)[0].token_ids
    batched = smollm.generate(PROMPTS, [params, SamplingParams(temperature=1.0, max_tokens=24), params])
    assert batched[0].token_ids == alone
    other_seed = smollm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24))
    assert other_seed[0].token_ids != alone


def test_temperature_zero_and_top_k_one_equal_greedy(smollm):
    greedy = [o.token_ids for o in smollm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))]
    top_k_one = smollm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=16))
    assert [o.token_ids for o in top_k_one] == greedy
    # rows of one batch mixing greedy and sampled requests keep their greedy rows exact
    mixed = smollm.generate(
        PROMPTS,
        [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=1.5, max_tokens=16)] * 1
        + [SamplingParams(temperature=0.0, max_tokens=16)],
    )
    assert mixed[0].token_ids == greedy[0] and mixed[2].token_ids == greedy[2]


def test_stop_strings_cut_the_text_exactly(smollm, hf_tokenizer):
    full = smollm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert " 8," in full.text
    stopped = smollm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=24, stop=(" 8,", "zz")))[0]
    assert stopped.text == full.text[: full.text.index(" 8,")]
    assert stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(full.token_ids)
    assert hf_tokenizer.decode(stopped.token_ids).startswith(stopped.text)


def test_streamed_deltas_add_up_to_the_final_text(smollm):
    engine = smollm.engine
    prompt = "Write a short poem about the sea."
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=("waves",))
    engine.add_request(prompt, params, request_id="stream")
    pieces, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            last = out
    (final,) = smollm.generate(prompt, params)  # the offline API's whole output
    assert last.finished and "".join(pieces) == final.text
    assert "waves" not in final.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_hugging_faces_log_softmax_at_every_generated_position(
    smollm, hf_model, hf_tokenizer, temperature
):
    """The returned logprob of each generated token and the top-n of its position equal
    log_softmax of Hugging Face's logits over the prompt plus the tokens generated before it
    (with temperature 1 too: logprobs are of the model, not of the sampling distribution)."""
    num_top, num_new = 5, 6
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=num_new, ignore_eos=True, logprobs=num_top)
    out = smollm.generate("The sky is", params)[0]
    assert len(out.token_ids) == len(out.logprobs) == num_new
    ids = hf_tokenizer("The sky is").input_ids
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]  # [num_new, vocab]
    ref = torch.log_softmax(logits.double(), dim=-1)  # [num_new, vocab]
    for position, (token_id, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top_values, top_ids = ref[position].topk(num_top)
        assert got.token_id == token_id
        assert got.logprob == pytest.approx(ref[position, token_id].item(), abs=1e-4), position
        assert sorted(got.top) == sorted(top_ids.tolist()), position
        for top_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert got.top[top_id] == pytest.approx(value, abs=1e-4), (position, top_id)


def _tensors(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None):
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p),
        generators=generators or {},
        all_greedy=temperature == 0,
        need_top_k=top_k > 0,
        need_top_p=top_p < 1,
        need_min_p=min_p > 0,
        max_num_logprobs=-1,
    )


def test_top_k_top_p_min_p_sample_only_inside_their_sets():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])).repeat(4000, 1)
    sampler = Sampler(torch.Generator().manual_seed(0))
    assert set(sampler(logits, _tensors(4000, top_k=2)).token_ids.tolist()) == {0, 1}
    assert set(sampler(logits, _tensors(4000, top_p=0.8)).token_ids.tolist()) == {0, 1, 2}  # 0.5+0.2 < 0.8
    assert set(sampler(logits, _tensors(4000, min_p=0.3)).token_ids.tolist()) == {0, 1, 2}  # >= 0.15
    counts = torch.bincount(sampler(logits, _tensors(4000)).token_ids, minlength=5).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), atol=0.03)
