"""Hugging Face directories: config.json + safetensors weights + tokenizer.json.

Weights: with `model.safetensors.index.json` its `weight_map` (tensor name -> shard file) says
where each tensor is, and `iter_weights(select)` opens only the shards holding a selected
tensor (an attention pod that skips the routed experts never opens an experts-only shard; a
`select` that rejects every name opens nothing). Without an index every `*.safetensors` file in
the directory is read (single-file checkpoints). Tensors come as stored: bf16/fp32, or
float8_e4m3fn plus float32 `*_scale_inv` in block-FP8 checkpoints (loader/fp8_checkpoint.py).
"""

from __future__ import annotations

import glob
import json
import os

from moemesh.engine.errors import ModelLoadError
from moemesh.engine.loader.checkpoint import Checkpoint
from moemesh.text.model_text import hf_dir_model_id, read_hf_config
from moemesh.text.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"


def open_hf_dir(path: str) -> Checkpoint:
    hf_config = read_hf_config(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        shards = _read_index(path, index)  # {file: [names]}
    else:
        shards = _list_files(path)
    num_tensors = sum(len(names) for names in shards.values())

    def iter_weights(select=None):
        from safetensors import safe_open

        for file, names in shards.items():
            wanted = [name for name in names if select is None or select(name)]  # unselected: never read
            if not wanted:
                continue
            try:
                with safe_open(file, framework="pt") as f:
                    for name in wanted:
                        tensor = f.get_tensor(name)
                        yield name, tensor
            except Exception as e:
                raise ModelLoadError(f"cannot read {file}: {e}") from e

    return Checkpoint(
        hf_config=hf_config,
        tokenizer=Tokenizer.from_hf_dir(path, hf_config),
        iter_weights=iter_weights,
        num_tensors=num_tensors,
        model_id=hf_dir_model_id(path),
    )


def _read_index(path: str, index: str) -> dict[str, list[str]]:
    """Shard file -> its tensor names, from the index's weight_map (files in first-use order)."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read {index}: it must be JSON with a 'weight_map' object ({e})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to shard files, got {weight_map!r:.80}")
    shards: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        shards.setdefault(os.path.join(path, str(file)), []).append(name)
    missing = [file for file in shards if not os.path.isfile(file)]
    if missing:
        raise ModelLoadError(f"{index} names shard {os.path.basename(missing[0])!r}, which is not in {path!r}")
    return shards


def _list_files(path: str) -> dict[str, list[str]]:
    """No index: every *.safetensors file, names read from each header."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path!r} has no *.safetensors weights")
    shards = {}
    try:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as f:
                shards[file] = list(f.keys())
    except Exception as e:
        raise ModelLoadError(f"cannot read safetensors in {path!r}: {e}") from e
    return shards
