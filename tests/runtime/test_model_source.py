"""Model sources resolve to a local checkpoint or fail with one line naming the source; the hf
init container's command (`moemesh fetch-model`) resolves a snapshot from a hub-layout cache the
way huggingface_hub lays it out, and the workers' settings then load the same snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moemesh.runtime.model_source_resolver import ModelSourceError, default_model_path, resolve_model_path
from moemesh.runtime.settings import SettingsError
from moemesh.worker.settings import worker_settings

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo: str, files: dict[str, str], revision: str = "main") -> str:
    """The layout huggingface_hub's cache uses: blobs, a snapshot of links, refs/<revision>."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / revision).write_text(COMMIT)
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for name, text in files.items():
        blob = repo_dir / "blobs" / f"blob-{len(name)}-{abs(hash(name))}"
        blob.write_text(text)
        os.symlink(blob, snapshot / name)
    return str(snapshot)


def write_config(tmp_path, source: dict) -> str:
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"mesh": "ns/m", "model": {"name": "m", "source": source}}))
    return str(path)


def fetch(config: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moemesh.cli", "fetch-model", "--config", config],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        timeout=120,
    )


def test_the_init_container_command_resolves_the_snapshot_the_workers_then_load(tmp_path):
    cache = tmp_path / "hf"
    snapshot = hub_cache(cache, "acme/tiny", {"config.json": "{}", "model.safetensors": "x"})
    source = {"kind": "hf", "repo": "acme/tiny", "revision": "main", "cacheDir": str(cache)}
    config = write_config(tmp_path, source)
    done = fetch(config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == snapshot
    from moemesh.cli import build_parser

    args = build_parser().parse_args(["serve", "--role", "decode", "--config", config])
    assert worker_settings(args, env={}).engine.model == snapshot


def test_an_hf_repo_missing_from_the_cache_fails_with_one_line_naming_it(tmp_path):
    cache = tmp_path / "hf"
    hub_cache(cache, "acme/tiny", {"config.json": "{}"})
    config = write_config(tmp_path, {"kind": "hf", "repo": "acme/absent", "revision": "main", "cacheDir": str(cache)})
    done = fetch(config)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf 'acme/absent'@main" in lines[0], done.stderr


def test_a_wrong_pvc_path_is_an_error_naming_the_claim_and_path_never_a_fallback(tmp_path):
    source = {"kind": "pvc", "claimName": "weights", "path": "typo", "localPath": str(tmp_path / "typo")}
    with pytest.raises(ModelSourceError, match=r"pvc 'weights' path 'typo': .*typo does not exist"):
        resolve_model_path(source)
    config = write_config(tmp_path, source)
    done = subprocess.run(
        [sys.executable, "-m", "moemesh.cli", "serve", "--role", "decode", "--config", config],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"moemesh: error: model source pvc 'weights' path 'typo': {tmp_path / 'typo'} does not exist in the pod"
    ]


def test_a_directory_with_one_gguf_file_means_that_file(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    source = {"kind": "hostPath", "path": "/data", "localPath": str(tmp_path)}
    assert resolve_model_path(source) == str(tmp_path / "m.gguf")
    (tmp_path / "n.gguf").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="2 .gguf files"):
        resolve_model_path(source)


def test_builtin_smollm2_is_the_gguf_in_the_wheel_and_unknown_builtins_are_errors():
    path = resolve_model_path({"kind": "builtin", "name": "smollm2"})
    assert path == default_model_path() and path.endswith(".gguf") and os.path.exists(path)
    with pytest.raises(ModelSourceError, match="builtin 'llama9'"):
        resolve_model_path({"kind": "builtin", "name": "llama9"})
    with pytest.raises(ModelSourceError, match="kind in"):
        resolve_model_path({"kind": "s3", "bucket": "x"})


def test_worker_settings_turn_an_unresolvable_source_into_a_settings_error(tmp_path):
    from moemesh.cli import build_parser

    config = write_config(tmp_path, {"kind": "hostPath", "path": "/nowhere", "localPath": str(tmp_path / "no")})
    args = build_parser().parse_args(["serve", "--role", "router", "--config", config])
    from moemesh.router.settings import router_settings

    with pytest.raises(SettingsError, match="hostPath '/nowhere'"):
        router_settings(args, env={})
