"""What the text layer needs from a checkpoint, without its weights: the Hugging Face config,
the tokenizer (with chat template) and the model id that keys the prefix cache.

The engine's loader builds its `Checkpoint` on the same functions, so a router and an engine
that open the same path agree on the tokenizer and on every block hash.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from moemesh.text.errors import ModelLoadError
from moemesh.text.gguf_metadata import GGUFMetadata, gguf_model_id, hf_config_from_gguf, open_reader
from moemesh.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelText:
    hf_config: dict  # Hugging Face config.json fields
    tokenizer: Tokenizer | None  # None: a directory without tokenizer.json (token-id prompts only)
    model_id: str  # identifies the weights in prefix-cache keys


def check_model_path(path: str) -> str:
    """'dir' or 'gguf'; a clear ModelLoadError for anything else."""
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist (give a .gguf file or a Hugging Face directory)")
    if os.path.isdir(path):
        return "dir"
    if path.endswith(".gguf"):
        return "gguf"
    raise ModelLoadError(f"model path {path!r} is neither a directory nor a .gguf file")


def open_model_text(path: str) -> ModelText:
    if check_model_path(path) == "dir":
        hf_config = read_hf_config(path)
        return ModelText(hf_config, Tokenizer.from_hf_dir(path, hf_config), hf_dir_model_id(path))
    reader = open_reader(path)
    return gguf_model_text(reader, path)


def gguf_model_text(reader, path: str) -> ModelText:
    meta = GGUFMetadata(reader)
    hf_config = hf_config_from_gguf(meta, {t.name for t in reader.tensors})
    return ModelText(
        hf_config, Tokenizer.from_gguf_metadata(meta.get), gguf_model_id(meta, path, os.stat(path).st_size)
    )


def read_hf_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ModelLoadError(f"{path!r} has no config.json")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e


def hf_dir_model_id(path: str) -> str:
    return os.path.abspath(path)
