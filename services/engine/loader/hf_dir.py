"""Hugging Face directories: config.json + *.safetensors shards + tokenizer.json."""

from __future__ import annotations

import glob
import os

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.text.model_text import hf_dir_model_id, read_hf_config
from moemesh.text.tokenizer import Tokenizer


def open_hf_dir(path: str) -> Checkpoint:
    hf_config = read_hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path!r} has no *.safetensors weights")

    def iter_weights(select=None):
        from safetensors import safe_open

        for file in files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        if select is None or select(name):  # unselected tensors are never read
                            yield name, f.get_tensor(name)
            except Exception as e:
                raise ModelLoadError(f"cannot read {file}: {e}") from e

    num_tensors = 0
    try:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as f:
                num_tensors += len(list(f.keys()))
    except Exception as e:
        raise ModelLoadError(f"cannot read safetensors in {path!r}: {e}") from e
    return Checkpoint(
        hf_config=hf_config,
        tokenizer=Tokenizer.from_hf_dir(path, hf_config),
        iter_weights=iter_weights,
        num_tensors=num_tensors,
        model_id=hf_dir_model_id(path),
    )
