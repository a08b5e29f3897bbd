"""Bad input is rejected at the boundary with an error naming the field, and nothing is left behind."""

from __future__ import annotations

import pytest

from moemesh import LLM, SamplingParams
from moemesh.engine.config import CacheConfig, SchedulerConfig
from moemesh.engine.errors import ConfigError, InvalidRequestError, ModelLoadError


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"stop": ("",)}, "stop"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_empty_and_overlong_prompts_are_rejected_and_nothing_is_queued(smollm):
    engine = smollm.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request([1] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, 10**9], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_leaves_nothing_half_applied(smollm):
    with pytest.raises(InvalidRequestError):
        smollm.generate(["fine prompt", ""], SamplingParams(max_tokens=2))
    assert not smollm.engine.has_unfinished_requests()
    assert smollm.generate("still serving", SamplingParams(max_tokens=2))[0].finished


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="GGUF"):
        LLM(str(bad))


def test_truncated_gguf_is_a_clear_error(tmp_path, smollm_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError):
        LLM(str(cut))


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))


def test_config_values_are_validated_once():
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=12)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8)
