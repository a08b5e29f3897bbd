"""Speculation flags of workers: parsed into settings, validated with messages naming the flag,
and turned into the engine's config; a decode worker's engine with n-gram speculation gives the
same greedy output as without it."""

from __future__ import annotations

import argparse

import pytest

from moemesh import SamplingParams
from moemesh.cli.serve_args import add_serve_arguments
from moemesh.engine.config import SpecConfig
from moemesh.engine.llm_engine import LLMEngine
from moemesh.runtime.settings import SettingsError
from moemesh.worker.main import engine_config
from moemesh.worker.settings import worker_settings

PROMPTS = [
    "Repeat the text exactly.\nText: red fish, blue fish, red fish, blue fish.\nRepeated text:",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Tell me about the moon.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def settings(*flags: str, role: str = "decode"):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return worker_settings(parser.parse_args(["--role", role, "--worker-id", "w1", *flags]), env={})


def run_greedy(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY, detokenize=False) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return [tokens[i] for i in ids]


def test_a_decode_worker_with_ngram_speculation_gives_the_greedy_output_without_it(smollm, smollm_path):
    flags = ("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--speculative-scheduling", "fixed")
    config = engine_config(settings("--model", smollm_path, "--num-blocks", "256", *flags).engine)
    assert config.spec == SpecConfig(method="ngram", num_speculative_tokens=3, scheduling="fixed")
    engine = LLMEngine(config, show_progress=False)
    assert run_greedy(engine, PROMPTS) == [o.token_ids for o in smollm.generate(PROMPTS, GREEDY)]
    assert engine.spec.stats.num_accepted_tokens > 0


def test_workers_do_not_speculate_by_default_and_prefill_workers_never():
    assert engine_config(settings().engine).spec == SpecConfig()
    assert engine_config(settings().engine).scheduler.async_scheduling  # execution overlap by default
    assert not engine_config(settings("--no-async-scheduling").engine).scheduler.async_scheduling
    prefill = settings("--speculative-method", "ngram", role="prefill")
    assert prefill.engine.config.spec.method == "none"


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--speculative-method", "draft"), "--speculative-method draft needs --draft-model"),
        (("--speculative-method", "ngram", "--draft-model", "/m"), "--draft-model is only used with"),
        (("--speculative-method", "draft", "--draft-model", "/nonexistent/draft"), "does not exist"),
        (("--speculative-method", "ngram", "--num-speculative-tokens", "0"), r"--num-speculative-tokens must be in"),
    ],
)
def test_bad_speculation_settings_name_the_flag(flags, message):
    with pytest.raises(SettingsError, match=message):
        settings(*flags)


@pytest.mark.parametrize("flag", ["--speculative-method", "--speculative-scheduling"])
def test_unknown_speculation_choices_are_usage_errors(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        settings(flag, "bogus")
    assert exit_info.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
