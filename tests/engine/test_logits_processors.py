"""Penalties, logit_bias and min_tokens: the batched sampler against a plain float64 reference of
vLLM's formulas, and through the engine on SmolLM2."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moemesh import SamplingParams
from moemesh.engine.runner.logits_processors import LogitsAdjustments
from moemesh.engine.runner.sampler import Sampler, SamplingTensors

VOCAB = 50
EOS = 7


@dataclass
class Row:
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_id: int | None = EOS


def vllm_reference(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """One row, float64, token by token: min_tokens mask, logit bias, then repetition, frequency
    and presence penalties (vLLM v1 Sampler order, `apply_penalties` formulas)."""
    p = row.sampling_params
    x = logits.double().clone()
    prompt, output = row.token_ids[: row.num_prompt_tokens], row.token_ids[row.num_prompt_tokens :]
    if len(output) < p.min_tokens:
        for t in [*p.stop_token_ids, *([] if p.ignore_eos else [row.eos_token_id])]:
            x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in output:
        x[t] -= p.frequency_penalty
    for t in set(output):
        x[t] -= p.presence_penalty
    return x


def tensors(rows: list[Row], temperature: float) -> SamplingTensors:
    n = len(rows)
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        generators={},
        all_greedy=temperature == 0,
        need_top_k=False,
        need_top_p=False,
        need_min_p=False,
        max_num_logprobs=-1,
        adjustments=LogitsAdjustments.build(rows, VOCAB, "cpu"),
    )


def random_rows(g: torch.Generator) -> list[Row]:
    def ids(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    return [
        Row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7), ids(12) + ids(9), 12),
        Row(SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=-1.0), ids(3) + ids(20), 3),
        Row(SamplingParams(), ids(5) + ids(2), 5),  # no adjustment: unchanged
        Row(SamplingParams(logit_bias={3: 100.0, 4: -100.0, 9: 2.5}), ids(6) + ids(4), 6),
        Row(SamplingParams(min_tokens=5, stop_token_ids=(11, 12), max_tokens=9), ids(4) + ids(2), 4),
        Row(SamplingParams(min_tokens=2, max_tokens=9, ignore_eos=True, stop_token_ids=(13,)), ids(4) + ids(2), 4),
        Row(SamplingParams(min_tokens=2, max_tokens=9), ids(4) + ids(3), 4),  # reached: no mask
        Row(
            SamplingParams(
                repetition_penalty=2.0, presence_penalty=2.0, logit_bias={1: -3.0}, min_tokens=4, max_tokens=8
            ),
            ids(30) + ids(1),
            30,
        ),
        Row(SamplingParams(frequency_penalty=1.0), ids(4), 4),  # no output yet
    ]


def test_adjusted_logits_equal_vllms_formulas_in_float64():
    g = torch.Generator().manual_seed(0)
    rows = random_rows(g)
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3  # [num_rows, vocab], both signs
    got = tensors(rows, 1.0).adjustments.apply(logits.clone())
    for i, row in enumerate(rows):
        ref = vllm_reference(logits[i], row)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got[i]), finite), i
        torch.testing.assert_close(got[i][finite].double(), ref[finite], rtol=1e-6, atol=1e-5, msg=f"row {i}")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_sampler_picks_greedy_and_samples_from_the_adjusted_distribution(temperature):
    g = torch.Generator().manual_seed(1)
    rows = random_rows(g)
    logits = torch.randn(len(rows), VOCAB, generator=g) * 3
    refs = torch.stack([vllm_reference(logits[i], row) for i, row in enumerate(rows)])  # [num_rows, vocab]
    sampler = Sampler(torch.Generator().manual_seed(0))
    t = tensors(rows, temperature)
    if temperature == 0:
        assert sampler(logits, t).token_ids.tolist() == refs.argmax(dim=-1).tolist()
        return
    probs = sampler.probs(t.adjustments.apply(logits.clone()), t)
    torch.testing.assert_close(probs.double(), torch.softmax(refs / temperature, dim=-1), rtol=1e-5, atol=1e-6)
    many = tensors(rows * 300, temperature)  # every sampled token is allowed by the reference
    sampled = sampler(logits.repeat(300, 1), many).token_ids.view(300, len(rows))
    assert bool(torch.isfinite(refs.gather(1, sampled.T)).all())


def test_a_token_biased_by_minus_100_is_never_picked_by_greedy_generation(smollm):
    prompt = "Count: one, two, three, four, five, six,"
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    greedy = smollm.generate(prompt, plain)[0].token_ids
    banned = greedy[0]
    biased = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={banned: -100.0})
    # batched with an unbiased request, which must not be affected
    outputs = smollm.generate([prompt, prompt], [biased, plain])
    assert banned not in outputs[0].token_ids and len(outputs[0].token_ids) == 12
    assert outputs[1].token_ids == greedy


def test_min_tokens_keeps_eos_away_until_reached(smollm):
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    short = smollm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 8  # ended by EOS
    longer = smollm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=8))[0]
    assert len(longer.token_ids) >= 8
    assert smollm.engine.eos_token_id not in longer.token_ids[:8]


def test_stop_strings_count_only_once_min_tokens_are_out(smollm):
    prompt = "1, 2, 3, 4,"
    full = smollm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    early = smollm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=(",",)))[0]
    late = smollm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=(",",), min_tokens=6))[0]
    assert early.text == full.text[: full.text.index(",")]
    assert late.finish_reason == "stop" and len(late.token_ids) >= 6 and "," in late.text
    assert full.text.startswith(late.text) and full.text[len(late.text)] == ","


def test_out_of_range_values_are_rejected_naming_the_field(smollm):
    from moemesh.engine.errors import InvalidRequestError

    for kwargs, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError) as e:
        smollm.generate("Hi", SamplingParams(logit_bias={10**7: 1.0}))
    assert e.value.param == "logit_bias"


def test_requests_that_adjust_their_logits_are_not_speculated():
    from moemesh.engine.config import SpecConfig
    from moemesh.engine.core.request import Request
    from moemesh.engine.sampling_params import StructuredOutputSpec
    from moemesh.engine.speculative.decoder import SpecDecoder

    spec = SpecDecoder(SpecConfig(method="ngram", scheduling="fixed", num_speculative_tokens=3), 1024, None)
    kinds = {
        "plain": {},
        "penalty": {"presence_penalty": 0.5},
        "bias": {"logit_bias": {5: 1.0}},
        "min_tokens": {"min_tokens": 2},
        "grammar": {"structured_output": StructuredOutputSpec("regex", "[0-9]+")},
    }
    requests = []
    for name, kwargs in kinds.items():
        request = Request(name, [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=8, **kwargs))
        request.num_computed_tokens = request.num_tokens - 1  # decoding
        requests.append(request)
    spec.prepare(requests)
    assert {r.request_id: bool(r.spec_token_ids) for r in requests} == {name: name == "plain" for name in kinds}
