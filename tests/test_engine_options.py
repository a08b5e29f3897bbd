"""The engine's one config definition (`moemesh.runtime.engine_config`) and the spellings generated
from it: LLM(...)'s keywords, `moemesh serve` / `generate` / `up` flags, the mesh config's engine
sections. A sample that sets every option to a value other than its default must come back
unchanged through each of them; adding an option without a sample value fails here, so no option
can be missing from a spelling. The CR's spelling is checked in tests/chart/test_engine_settings.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

from moemesh.cli import build_parser
from moemesh.runtime import engine_args
from moemesh.runtime.engine_config import (
    BY_NAME,
    GROUPS,
    OPTIONS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SpecConfig,
    build,
    options_of,
)
from moemesh.runtime.settings import SettingsError
from moemesh.worker.settings import worker_settings

# every option, none at its default, together valid (a draft model is a file: see `sample`)
SAMPLE = {
    "model": "/models/target.gguf",
    "dtype": "float32",
    "device": "cuda:1",
    "max_model_len": 4096,
    "seed": 7,
    "micro_batch_overlap": True,
    "quantization": "none",
    "block_size": 32,
    "num_blocks": 512,
    "kv_memory_gib": 3.5,
    "enable_prefix_caching": False,
    "cache_salt": "tenant-a",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "enable_chunked_prefill": False,
    "async_scheduling": False,
    "speculative_method": "draft",
    "num_speculative_tokens": 3,
    "speculative_scheduling": "fixed",
    "ngram_min_n": 1,
    "ngram_max_n": 3,
    "draft_model": "/models/draft.gguf",
    "draft_dtype": "bfloat16",
    "draft_num_layers": 2,
    "draft_kv_memory_gib": 0.25,
}


@pytest.fixture()
def sample(tmp_path) -> dict:
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"")  # a worker checks that the draft model exists
    return {**SAMPLE, "draft_model": str(draft)}


def serve(*flags: str, role: str = "decode"):
    return worker_settings(build_parser().parse_args(["serve", "--role", role, "--worker-id", "w", *flags]), env={})


def spelled(values: dict) -> dict:
    return {name: BY_NAME[name].spell(value) for name, value in values.items()}


# -- the definition --------------------------------------------------------------------------------


def test_the_sample_sets_every_option_and_none_at_its_default():
    assert list(SAMPLE) == [o.name for o in OPTIONS]
    assert [o.name for o in OPTIONS if SAMPLE[o.name] == o.default] == []
    assert options_of(build(SAMPLE)) == SAMPLE


def test_every_config_field_is_a_documented_option_or_declared_internal():
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert ("option" in f.metadata) != ("internal" in f.metadata), f"{group}.{f.name}"
    assert all(o.doc and o.roles for o in OPTIONS)
    internal = [
        f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls) if "internal" in f.metadata
    ]
    assert internal == ["model.load_routed_experts"]  # the worker derives it from its expert settings


def test_configs_are_frozen_and_validated_once_with_the_bounds_on_their_fields():
    config = build(SAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 64  # type: ignore[misc]
    cases = {
        "block_size": (12, "block_size must be a power of two, got 12"),
        "num_speculative_tokens": (17, r"num_speculative_tokens must be in \[1, 16\], got 17"),
        "kv_memory_gib": (0.0, "kv_memory_gib must be > 0, got 0.0"),
        "max_num_seqs": (True, "max_num_seqs must be an integer, got True"),
        "device": ("tpu", r"device must match cpu\|cuda"),
        "micro_batch_overlap": ("on", "micro_batch_overlap must be one of auto, on, off; got 'on'"),
        "dtype": ("int8", "dtype must be one of auto, float32, bfloat16, float16; got 'int8'"),
        "max_model_len": (1, "max_model_len must be >= 2, got 1"),
    }
    for name, (value, message) in cases.items():
        with pytest.raises(ConfigError, match=message):
            build({**SAMPLE, name: value})


def test_an_error_names_each_field_as_the_surface_that_set_it_spells_it():
    with pytest.raises(ConfigError) as info:
        SpecConfig(method="draft")
    assert str(info.value) == "speculative_method draft needs draft_model (a GGUF file or HF directory)"
    flags = info.value.named(lambda name: BY_NAME[name].flag)
    assert flags == "--speculative-method draft needs --draft-model (a GGUF file or HF directory)"
    assert CacheConfig(16, None, 1.0).memory_gib == 1.0  # positional fields keep their order


# -- LLM(...) --------------------------------------------------------------------------------------


def test_llm_takes_every_option_by_its_name_and_its_signature_lists_them_with_their_defaults():
    from moemesh.engine.llm import LLM, llm_config

    params = inspect.signature(LLM).parameters
    engine = {name: p.default for name, p in params.items() if name not in ("speculative", "show_progress")}
    assert engine == {o.name: o.default for o in OPTIONS}
    assert options_of(llm_config(SAMPLE["model"], None, {k: v for k, v in SAMPLE.items() if k != "model"})) == SAMPLE
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_cache_gib'"):
        llm_config(None, None, {"kv_cache_gib": 1.0})
    with pytest.raises(ConfigError, match="not both"):
        llm_config(None, SpecConfig(method="ngram"), {"num_speculative_tokens": 2})
    speculative = SpecConfig(method="ngram", scheduling="fixed")
    assert llm_config(None, speculative, {"block_size": 32}).spec == speculative  # the existing keyword
    assert llm_config(None, None, {}).model.model.endswith(".gguf")  # unset: the default model


# -- flags -----------------------------------------------------------------------------------------


def test_moemesh_serve_help_lists_every_engine_option_that_llm_takes():
    from moemesh.engine.llm import LLM

    text = subprocess.run(
        [sys.executable, "-m", "moemesh.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    keywords = [
        name for name in inspect.signature(LLM).parameters if name not in ("self", "speculative", "show_progress")
    ]
    assert keywords == [o.name for o in OPTIONS]  # LLM's keywords are the definition's options
    for name in keywords:
        o = BY_NAME[name]
        listed = f"{o.flag}, --no-{o.flag[2:]}" if o.kind is bool and o.choices is None else f"{o.flag} "
        assert listed in text, name
        assert " ".join(o.doc.split()[:4]) in " ".join(text.split()), f"{name}: its help is the field's doc"
    for flag in (
        "--quantization",
        "--no-enable-prefix-caching",
        "--cache-salt",
        "--no-enable-chunked-prefill",
        "--ngram-min-n",
        "--draft-kv-memory-gib",
    ):
        assert flag in text


def test_serve_flags_reach_the_workers_engine_config(sample):
    settings = serve(*engine_args.argv(sample))
    assert options_of(settings.engine.config) == sample


def test_the_existing_serve_flags_keep_their_names_and_defaults():
    config = serve().engine.config
    assert (config.cache.memory_gib, config.cache.block_size, config.model.dtype) == (1.0, 16, "auto")  # a worker's
    assert (config.model.micro_batch_overlap, config.scheduler.async_scheduling) == (None, True)
    config = serve("--no-async-scheduling", "--micro-batch-overlap", "off", "--num-blocks", "64").engine.config
    assert (config.scheduler.async_scheduling, config.model.micro_batch_overlap, config.cache.num_blocks) == (
        False,
        False,
        64,
    )


def test_each_role_reads_only_its_options():
    flags = engine_args.argv(
        {"speculative_method": "ngram", "dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 64}
    )
    prefill, expert = serve(*flags, role="prefill").engine.config, serve(*flags, role="expert").engine.config
    assert (prefill.spec.method, prefill.model.dtype, prefill.scheduler.max_num_seqs) == ("none", "float32", 4)
    assert (expert.spec.method, expert.model.dtype, expert.scheduler.max_num_seqs) == ("none", "float32", 64)


def test_moemesh_generate_takes_the_same_flags_but_seed(sample, monkeypatch, capsys):
    import moemesh.engine.llm
    from moemesh import cli

    seen = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def generate(self, prompts, params):
            return [type("Output", (), {"text": "done"})() for _ in prompts]

    monkeypatch.setattr(moemesh.engine.llm, "LLM", RecordingLLM)
    flags = engine_args.argv({k: v for k, v in sample.items() if k != "seed"})
    assert cli.main(["generate", "hi", "--seed", "5", *flags]) == 0
    speculative = seen.pop("speculative")
    assert options_of(dataclasses.replace(build(seen), spec=speculative)) == {**sample, "seed": 0}
    assert capsys.readouterr().out.strip() == "done"


# -- the mesh config -------------------------------------------------------------------------------


def write(tmp_path, config: dict) -> str:
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_the_mesh_config_engine_sections_reach_the_worker(tmp_path, sample):
    mesh_values = spelled({k: v for k, v in sample.items() if k != "model"})
    config = write(tmp_path, {"engine": mesh_values})
    assert options_of(serve("--config", config, "--model", sample["model"]).engine.config) == sample
    mesh_wide = {k: v for k, v in mesh_values.items() if not BY_NAME[k].per_role}
    own = {k: v for k, v in mesh_values.items() if BY_NAME[k].per_role}
    config = write(tmp_path, {"engine": mesh_wide, "roles": {"decode": {"engine": own}}})
    assert options_of(serve("--config", config, "--model", sample["model"]).engine.config) == sample
    assert serve("--config", config, role="prefill").engine.config.scheduler.max_num_seqs == 64  # decode's own


def test_a_flag_wins_over_the_role_section_which_wins_over_the_engine_section(tmp_path):
    config = write(
        tmp_path,
        {"engine": {"max_num_seqs": 8, "kv_memory_gib": 3}, "roles": {"decode": {"engine": {"max_num_seqs": 16}}}},
    )
    assert serve("--config", config).engine.config.scheduler.max_num_seqs == 16
    assert serve("--config", config, role="prefill").engine.config.scheduler.max_num_seqs == 8
    assert serve("--config", config, "--max-num-seqs", "64").engine.config.scheduler.max_num_seqs == 64  # = default
    assert serve("--config", config).engine.config.cache.memory_gib == 3
    assert serve().engine.config.cache.memory_gib == 1.0


def test_the_router_hashes_prefixes_with_the_workers_mesh_wide_values(tmp_path):
    """Block size, cache salt and context are one value per mesh: the router reads them from the
    mesh config (or its flags) as the workers do, so its block-hash chain matches theirs."""
    from moemesh.router.settings import router_settings

    config = write(tmp_path, {"engine": {"block_size": 32, "cache_salt": "tenant-a", "max_model_len": 1024}})
    for flags in ((), ("--block-size", "64", "--cache-salt", "tenant-b")):
        args = build_parser().parse_args(["serve", "--role", "router", "--config", config, *flags])
        router = router_settings(args, env={})
        worker = serve("--config", config, *flags).engine.config
        assert (router.block_size, router.cache_salt, router.max_model_len) == (
            worker.cache.block_size,
            worker.cache.cache_salt,
            worker.model.max_model_len,
        )
    assert (router.block_size, router.cache_salt) == (64, "tenant-b")


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"engine": {"num_speculative_tokens": 17}},
            r"mesh config engine.num_speculative_tokens must be in \[1, 16\], got 17",
        ),
        (
            {"roles": {"decode": {"engine": {"max_num_batched_tokens": 8}}}},
            r"mesh config roles.decode.engine.max_num_batched_tokens \(8\) must be >= --max-num-seqs \(64\)",
        ),
        ({"engine": {"micro_batch_overlap": True}}, "micro_batch_overlap must be one of auto, on, off; got True"),
        ({"engine": {"kv_cache_gib": 1}}, "mesh config engine.kv_cache_gib: not an engine option"),
        ({"engine": {"model": "/m"}}, "mesh config engine.model: not an engine option"),
        ({"roles": {"decode": {"engine": {"block_size": 32}}}}, "one value for the whole mesh; set it in engine"),
        ({"engine": [1]}, "mesh config engine must be an object"),
    ],
)
def test_a_bad_mesh_config_value_is_a_settings_error_naming_its_key(tmp_path, config, message):
    with pytest.raises(SettingsError, match=message):
        serve("--config", write(tmp_path, config))


def test_a_flag_error_names_the_flag():
    with pytest.raises(SettingsError, match="--block-size must be a power of two, got 12"):
        serve("--block-size", "12")
    with pytest.raises(SettingsError, match=r"--draft-model '/nonexistent' does not exist"):
        serve("--speculative-method", "draft", "--draft-model", "/nonexistent")


def test_the_definition_imports_no_torch():
    script = (
        "import sys\n"
        "import moemesh.runtime.engine_config, moemesh.runtime.engine_args, moemesh.operator.engine_schema\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert EngineConfig() == build({})
