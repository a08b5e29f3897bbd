"""YaRN RoPE against Hugging Face transformers: tiny random Qwen3-MoE (generic YaRN, cos/sin
attention factor 0.1 ln(factor) + 1, untruncated correction range) and DeepSeek-V3 (MLA; cos/sin
factor mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale times
mscale(factor, mscale_all_dim)^2) checkpoints with original_max_position_embeddings 32 and factor 4,
saved by transformers. Prompts are longer than 32 tokens, so positions past the pre-training
length are served. Greedy tokens identical, float32 logits within 1e-4 relative; bad
rope_scaling fields are named in the error."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from moemesh import LLM, SamplingParams
from moemesh.engine.errors import ModelLoadError

from ..oracle_helpers import max_rel_error, prefill_then_decode_logits
from .models import VOCAB, build_deepseek_v3, build_qwen3_moe, hf_greedy, save_tiny

ORIGINAL_MAX, FACTOR, MAX_NEW = 32, 4.0, 12
# Small betas put the YaRN ramp inside the few rotary dims of these tiny heads (16 and 8), so
# some frequencies are interpolated, some extrapolated and some blended.
YARN = {
    "qwen3_moe": dict(
        rope_type="yarn",
        factor=FACTOR,
        original_max_position_embeddings=ORIGINAL_MAX,
        beta_fast=2.0,
        beta_slow=0.25,
        truncate=False,
        rope_theta=10000.0,
    ),
    "deepseek_v3": dict(
        rope_type="yarn",
        factor=FACTOR,
        original_max_position_embeddings=ORIGINAL_MAX,
        beta_fast=1.0,
        beta_slow=0.125,
        mscale=0.707,
        mscale_all_dim=1.0,
        rope_theta=10000.0,
    ),
}
BUILDERS = {"qwen3_moe": build_qwen3_moe, "deepseek_v3": build_deepseek_v3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _builder(arch: str, rope_parameters: dict | None):
    max_position = int(ORIGINAL_MAX * FACTOR)  # 128: what factor says the context was stretched to
    return functools.partial(BUILDERS[arch], max_position_embeddings=max_position, rope_parameters=rope_parameters)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (40, 57, 35)]


def _engine(path: str) -> LLM:
    return LLM(path, block_size=4, num_blocks=96, show_progress=False)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def yarn(request, tmp_path_factory):
    """(architecture, checkpoint dir, HF model) with YaRN rope_parameters."""
    path = str(tmp_path_factory.mktemp(f"yarn_{request.param}"))
    hf = save_tiny(_builder(request.param, dict(YARN[request.param])), path)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    return request.param, path, hf


def test_greedy_tokens_past_the_original_context_match_hf(yarn):
    _, path, hf = yarn
    prompts = _prompts()
    assert min(len(p) for p in prompts) > ORIGINAL_MAX
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert [o.token_ids for o in _engine(path).generate(prompts, GREEDY)] == expected


def test_logits_past_the_original_context_match_hf_within_1e_4(yarn):
    arch, path, hf = yarn
    ids = _prompts()[1] + _prompts()[0][:13]  # 70 tokens: prefill 69, decode 1
    assert len(ids) > ORIGINAL_MAX
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [num_tokens, vocab]
    assert max_rel_error(prefill_then_decode_logits(_engine(path), ids), ref) < 1e-4
    # the scaling matters: the same weights with plain RoPE give visibly different logits
    torch.manual_seed(0)
    plain = _builder(arch, {"rope_type": "default", "rope_theta": 10000.0})().eval()
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert max_rel_error(plain(torch.tensor([ids])).logits[0], ref) > 1e-2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rope: rope.update(rope_type="yarn_v2"), r"rope_scaling\.rope_type 'yarn_v2' is not supported"),
        (lambda rope: rope.pop("factor"), r"rope_scaling\.factor is missing"),
        (lambda rope: rope.update(factor="four"), r"rope_scaling\.factor must be a number"),
        (lambda rope: rope.update(beta_fast=[32]), r"rope_scaling\.beta_fast must be a number"),
    ],
)
def test_a_bad_rope_scaling_is_a_load_error_naming_the_field(yarn, tmp_path, edit, message):
    _, path, _ = yarn
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    with open(f"{bad}/config.json") as f:
        config = json.load(f)
    edit(config["rope_parameters"])
    with open(f"{bad}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match=message):
        LLM(bad, num_blocks=8, show_progress=False)
