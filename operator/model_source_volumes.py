"""The CR's typed model source -> the pod volumes, mounts and init container that make it a local
path, and the resolved source written into `mesh.json` (read by `moemesh.runtime.model_source_resolver`).

    builtin: smollm2                       the GGUF the services image ships
    pvc: {claimName, path}                 the claim mounted read-only at /models; model at /models/<path>
    hostPath: {path}                       the node path mounted read-only at /models/host
    hf: {repo, revision, tokenSecretRef, endpoint, cacheClaimName}
                                           an init container (`moemesh fetch-model`) downloads the
                                           snapshot into the cache volume; workers resolve it offline
A source the operator can tell is wrong raises SpecError (the ModelSource condition); one it
cannot check from here (a wrong path inside a claim) makes the pod exit with one line naming it.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

KINDS = ("builtin", "pvc", "hostPath", "hf")
BUILTINS = ("smollm2",)
MODELS_DIR = "/models"
HF_CACHE = "/var/cache/moemesh/hf"


class SourceError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str
    fields: tuple[tuple[str, Any], ...]  # the CR's fields of that kind, in order

    def get(self, key: str, default=None):
        return dict(self.fields).get(key, default)

    def resolved(self) -> dict[str, Any]:
        """The `mesh.json` form (see moemesh.runtime.model_source_resolver)."""
        if self.kind == "builtin":
            return {"kind": "builtin", "name": self.get("name")}
        if self.kind == "pvc":
            path = self.get("path")
            return {
                "kind": "pvc",
                "claimName": self.get("claimName"),
                "path": path,
                "localPath": posixpath.join(MODELS_DIR, path),
            }
        if self.kind == "hostPath":
            return {"kind": "hostPath", "path": self.get("path"), "localPath": posixpath.join(MODELS_DIR, "host")}
        return {
            "kind": "hf",
            "repo": self.get("repo"),
            "revision": self.get("revision") or "main",
            "cacheDir": HF_CACHE,
        }

    def volumes(self) -> list[dict[str, Any]]:
        if self.kind == "pvc":
            return [{"name": "model", "persistentVolumeClaim": {"claimName": self.get("claimName"), "readOnly": True}}]
        if self.kind == "hostPath":
            return [{"name": "model", "hostPath": {"path": self.get("path")}}]
        if self.kind == "hf":
            claim = self.get("cacheClaimName")
            return [
                {
                    "name": "model-cache",
                    **({"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}),
                }
            ]
        return []

    def mounts(self) -> list[dict[str, Any]]:
        if self.kind == "pvc":
            return [{"name": "model", "mountPath": MODELS_DIR, "readOnly": True}]
        if self.kind == "hostPath":
            return [{"name": "model", "mountPath": posixpath.join(MODELS_DIR, "host"), "readOnly": True}]
        if self.kind == "hf":
            return [{"name": "model-cache", "mountPath": HF_CACHE}]
        return []

    def init_containers(self, image: str, pull_policy: str, config_path: str, security: dict) -> list[dict[str, Any]]:
        if self.kind != "hf":
            return []
        env: list[dict[str, Any]] = []
        secret = self.get("tokenSecretRef")
        if secret:
            env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret.get("key", "token")}},
                }
            )
        if self.get("endpoint"):
            env.append({"name": "HF_ENDPOINT", "value": self.get("endpoint")})
        return [
            {
                "name": "fetch-model",
                "image": image,
                "imagePullPolicy": pull_policy,
                "command": ["moemesh", "fetch-model", "--config", config_path],
                "env": env,
                "securityContext": security,
                "volumeMounts": [
                    {"name": "config", "mountPath": posixpath.dirname(config_path), "readOnly": True},
                    {"name": "model-cache", "mountPath": HF_CACHE},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ]


def parse_source(source: Any) -> ModelSource:
    """Exactly one kind, with its required fields (messages name the field)."""
    if not isinstance(source, dict) or len(source) != 1 or next(iter(source)) not in KINDS:
        raise SourceError(f"spec.model.source must have exactly one of {', '.join(KINDS)}, got {source!r}")
    kind, body = next(iter(source.items()))
    if kind == "builtin":
        if body not in BUILTINS:
            raise SourceError(f"spec.model.source.builtin must be one of {BUILTINS}, got {body!r}")
        return ModelSource("builtin", (("name", body),))
    if not isinstance(body, dict):
        raise SourceError(f"spec.model.source.{kind} must be an object, got {body!r}")
    if kind == "pvc":
        claim, path = body.get("claimName"), body.get("path")
        if not claim or not isinstance(path, str) or not path:
            raise SourceError("spec.model.source.pvc needs claimName and path")
        if path.startswith("/") or ".." in path.split("/"):
            raise SourceError(f"spec.model.source.pvc.path must be relative to the claim, without '..', got {path!r}")
    elif kind == "hostPath":
        path = body.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise SourceError(f"spec.model.source.hostPath.path must be an absolute node path, got {path!r}")
    else:
        if not body.get("repo") or not isinstance(body["repo"], str):
            raise SourceError("spec.model.source.hf.repo is required (e.g. deepseek-ai/DeepSeek-V3)")
        secret = body.get("tokenSecretRef")
        if secret is not None and (not isinstance(secret, dict) or not secret.get("name")):
            raise SourceError("spec.model.source.hf.tokenSecretRef needs a name (and a key, default 'token')")
    return ModelSource(kind, tuple(body.items()))
