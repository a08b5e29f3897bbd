"""The draft-model proposer on a tiny random Llama, against transformers running the same
checkpoint without any cache: drafts, confidences, KV rollback after rejections, freeing."""

from __future__ import annotations

import pytest
import torch

from moemesh.engine.config import ModelConfig, SpecConfig
from moemesh.engine.errors import ConfigError, ModelLoadError
from moemesh.engine.speculative.draft_model import load_draft_proposer

from .conftest import SMOLLM_VOCAB, save_tiny_llama

K = 4
PROMPT_A = list(range(100, 140))  # 40 tokens: three blocks
PROMPT_B = [7, 300, 12, 9000, 45]


def load(path: str, **spec_kw):
    spec = SpecConfig(method="draft", draft_model=path, num_speculative_tokens=K, **spec_kw)
    return load_draft_proposer(spec, ModelConfig(path), SMOLLM_VOCAB)


@pytest.fixture(scope="module")
def proposer(tiny_draft):
    return load(tiny_draft[0], draft_kv_memory_gib=0.01)


def hf_greedy(model, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """k greedy tokens and their probabilities, recomputing the whole sequence every step."""
    tokens, drafts, probs = list(tokens), [], []
    with torch.no_grad():
        for _ in range(k):
            p = torch.softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            drafts.append(int(p.argmax()))
            probs.append(float(p.max()))
            tokens.append(drafts[-1])
    return drafts, probs


def test_drafts_are_the_draft_models_greedy_continuation_with_its_probabilities(proposer, tiny_draft):
    proposals = proposer.propose({"a": PROMPT_A, "b": PROMPT_B}, K)
    for request_id, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        drafts, probs = hf_greedy(tiny_draft[1], prompt, K)
        assert proposals[request_id].token_ids == drafts
        assert proposals[request_id].confidences == pytest.approx(probs, rel=1e-3)
        assert proposals[request_id].draft_probs is None  # point masses


def test_after_rejections_the_draft_cache_holds_the_real_prefix_and_drafts_as_from_scratch(proposer, tiny_draft):
    first = proposer.propose({"a": PROMPT_A, "b": PROMPT_B, "c": PROMPT_B}, K)
    assert proposer.cached_token_ids("a") == PROMPT_A + first["a"].token_ids[:-1]  # the last draft is never fed
    d_a, d_b, d_c = first["a"].token_ids, first["b"].token_ids, first["c"].token_ids
    wrong = (d_a[1] + 1) % SMOLLM_VOCAB
    real = {
        "a": PROMPT_A + d_a[:1] + [wrong],  # one draft accepted, then a correction
        "b": PROMPT_B + d_b + [11],  # every draft accepted, plus the bonus token
        "c": PROMPT_B + d_c[:1],  # not verified this round; its one new token equals draft 1
    }
    second = proposer.propose(real, K)
    scratch = proposer.propose({f"{r}-scratch": tokens for r, tokens in real.items()}, K)
    for request_id, tokens in real.items():
        drafts, _ = hf_greedy(tiny_draft[1], tokens, K)
        assert second[request_id].token_ids == drafts == scratch[f"{request_id}-scratch"].token_ids
        assert proposer.cached_token_ids(f"{request_id}-scratch") == tokens + drafts[:-1]


def test_a_reused_request_id_with_other_tokens_starts_over(proposer, tiny_draft):
    proposer.propose({"x": PROMPT_A}, K)
    other = [5, 6, 7, 8, 9, 10]
    assert proposer.propose({"x": other}, K)["x"].token_ids == hf_greedy(tiny_draft[1], other, K)[0]
    assert proposer.cached_token_ids("x")[: len(other)] == other


def test_requests_no_longer_proposed_for_free_their_blocks(proposer):
    proposer.propose({}, K)
    num_free = proposer.num_free_blocks
    proposer.propose({"a": PROMPT_A, "b": PROMPT_B}, K)
    assert proposer.num_free_blocks == num_free - 3 - 1  # 40 + 3 fed drafts: 3 blocks; 5 + 3: one
    proposer.propose({"b": PROMPT_B}, K)  # "a" finished or was preempted
    assert proposer.num_free_blocks == num_free - 1 and proposer.cached_token_ids("a") == []
    proposer.propose({}, K)
    assert proposer.num_free_blocks == num_free and not proposer.states


def test_a_request_that_does_not_fit_the_draft_cache_gets_no_draft(tiny_draft):
    small = load(tiny_draft[0], draft_kv_memory_gib=1e-5)  # the 2-block minimum: one usable block, 16 tokens
    assert small.num_free_blocks == 1
    proposals = small.propose({"long": PROMPT_A, "short": PROMPT_B}, K)
    assert list(proposals) == ["short"]
    assert proposals["short"].token_ids == hf_greedy(tiny_draft[1], PROMPT_B, K)[0]


def test_draft_num_layers_keeps_the_first_layers_of_the_model(tiny_draft):
    from transformers import LlamaForCausalLM

    path, model = tiny_draft
    config = model.config.to_dict() | {"num_hidden_layers": 1}
    one_layer = LlamaForCausalLM(type(model.config).from_dict(config)).eval()
    missing, unexpected = one_layer.load_state_dict(model.state_dict(), strict=False)
    assert not missing and unexpected  # layer 1's weights are left out
    cut = load(path, draft_num_layers=1, draft_kv_memory_gib=0.01)
    assert cut.propose({"a": PROMPT_B}, K)["a"].token_ids == hf_greedy(one_layer, PROMPT_B, K)[0]
    with pytest.raises(ConfigError, match="draft_num_layers is 3 but the draft model has 2 layers"):
        load(path, draft_num_layers=3)


def test_a_draft_with_another_vocabulary_is_rejected(tmp_path):
    save_tiny_llama(str(tmp_path), vocab_size=128)
    with pytest.raises(ConfigError, match="vocabulary of 128 tokens, the target 49152"):
        load(str(tmp_path))


def test_a_missing_draft_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="draft model: .* does not exist"):
        load(str(tmp_path / "nope"))


def test_spec_config_checks_the_draft_fields():
    with pytest.raises(ConfigError, match="needs draft_model"):
        SpecConfig(method="draft")
    with pytest.raises(ConfigError, match="only used with speculative method 'draft'"):
        SpecConfig(method="ngram", draft_model="/some/model")
    with pytest.raises(ConfigError, match="draft_dtype"):
        SpecConfig(method="draft", draft_model="/m", draft_dtype="int8")
    with pytest.raises(ConfigError, match="draft_num_layers"):
        SpecConfig(method="draft", draft_model="/m", draft_num_layers=0)
