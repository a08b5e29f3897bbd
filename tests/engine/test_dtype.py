"""dtype "auto" (engine/dtype.py): resolved from the CPU's flags (patched here), logged once at
start, and an explicit bf16 on a CPU without native bf16 warned about once."""

from __future__ import annotations

import logging

import pytest

from moemesh.engine import dtype
from moemesh.engine.config import ModelConfig
from moemesh.engine.errors import ConfigError


@pytest.fixture
def flags(monkeypatch):
    def use(*names: str) -> None:
        monkeypatch.setattr(dtype, "cpu_flags", lambda: frozenset(names))

    monkeypatch.setattr(dtype, "_warned", set())
    return use


@pytest.mark.parametrize("native", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bfloat16_on_a_cpu_with_native_bf16(flags, native, caplog):
    flags("avx2", "avx512f", native)
    with caplog.at_level(logging.INFO, logger="moemesh.engine.dtype"):
        assert dtype.resolve_dtype("auto", "cpu") == "bfloat16"
    assert "dtype auto -> bfloat16" in caplog.text


def test_auto_is_float32_on_a_cpu_without_native_bf16(flags, caplog):
    flags("avx2", "avx512f", "avx512_vnni")
    with caplog.at_level(logging.INFO, logger="moemesh.engine.dtype"):
        assert dtype.resolve_dtype("auto", "cpu") == "float32"
    assert "dtype auto -> float32" in caplog.text


def test_auto_is_bfloat16_on_a_gpu_whatever_the_cpu(flags):
    flags()
    assert dtype.resolve_dtype("auto", "cuda") == "bfloat16"


def test_explicit_bfloat16_without_native_bf16_warns_once_and_is_kept(flags, caplog):
    flags("avx2")
    with caplog.at_level(logging.WARNING, logger="moemesh.engine.dtype"):
        assert dtype.resolve_dtype("bfloat16", "cpu") == "bfloat16"
        assert dtype.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "without native bf16" in caplog.text


def test_explicit_dtypes_are_kept_without_a_warning_where_bf16_is_native(flags, caplog):
    flags("avx512_bf16")
    with caplog.at_level(logging.WARNING, logger="moemesh.engine.dtype"):
        assert [dtype.resolve_dtype(d, "cpu") for d in ("float32", "bfloat16")] == ["float32", "bfloat16"]
    assert caplog.records == []


def test_model_config_defaults_to_auto_and_rejects_unknown_dtypes():
    assert ModelConfig("m.gguf").dtype == "auto"
    with pytest.raises(ConfigError, match="dtype"):
        ModelConfig("m.gguf", dtype="int8")


def test_the_engine_resolves_auto_once_and_builds_the_model_in_that_dtype(flags, smollm_path):
    from moemesh import LLM

    flags("avx512_bf16")
    llm = LLM(smollm_path, num_blocks=16, show_progress=False)
    assert llm.engine.config.model.dtype == "bfloat16"
    assert llm.engine.model.model.norm.weight.dtype.is_floating_point
    assert str(llm.engine.model.model.norm.weight.dtype) == "torch.bfloat16"
