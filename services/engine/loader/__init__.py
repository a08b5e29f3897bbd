"""Checkpoint loading: a GGUF file or a Hugging Face directory -> (HF-style config, named
weights, tokenizer). Models only ever see Hugging Face parameter names."""

from __future__ import annotations

from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.runtime.model_source_resolver import default_model_path
from moemesh.text.model_text import check_model_path

__all__ = ["Checkpoint", "default_model_path", "open_checkpoint"]


def open_checkpoint(path: str) -> Checkpoint:
    if check_model_path(path) == "dir":
        from moemesh.engine.loader.hf_dir import open_hf_dir

        return open_hf_dir(path)
    from moemesh.engine.loader.gguf_file import open_gguf

    return open_gguf(path)
