"""The operator's Kubernetes client for its children: lightkube's ``AsyncClient``.

It reuses the credentials kopf's login produced (``kopf.ConnectionInfo``), so the operator logs
in once; nothing is written to disk by this module (lightkube turns inline certificate data into
temporary files that it deletes as soon as the SSL context has loaded them).

``apply`` converges one child: create when missing, else a three-way JSON merge patch
(``moemesh.operator.merge``) carrying the live ``resourceVersion`` (a concurrent writer makes it
fail with 409 instead of being overwritten); no write when nothing changed. The desired object is
recorded in the ``moemesh.io/last-applied`` annotation so removed fields are removed live too.
"""

from __future__ import annotations

import base64
import json
from typing import Any, cast

import httpx2
import kopf
from lightkube import ApiError, AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Pod, Secret, Service
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType

from moemesh.operator.merge import merge_patch

Manifest = dict[str, Any]
LAST_APPLIED = "moemesh.io/last-applied"

InferenceMesh = create_namespaced_resource("moemesh.io", "v1alpha1", "InferenceMesh", "inferencemeshes")

RESOURCES: dict[str, Any] = {  # lightkube resource classes by kind
    "ConfigMap": ConfigMap,
    "Secret": Secret,
    "Service": Service,
    "Deployment": Deployment,
    "StatefulSet": StatefulSet,
    "PodDisruptionBudget": PodDisruptionBudget,
    "Pod": Pod,
    "InferenceMesh": InferenceMesh,
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API error {status}: {message}")
        self.status = status


def _b64(value: str | bytes | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def kubeconfig_from(info: kopf.ConnectionInfo) -> KubeConfig:
    """An in-memory lightkube config with the same server and credentials as kopf's login."""
    cluster: dict[str, Any] = {"server": info.server}
    if info.insecure:
        cluster["insecure-skip-tls-verify"] = True
    if info.ca_path:
        cluster["certificate-authority"] = str(info.ca_path)
    elif info.ca_data:
        cluster["certificate-authority-data"] = _b64(info.ca_data)
    user: dict[str, Any] = {}
    if info.token:
        user["token"] = info.token
    elif info.username and info.password:
        user.update(username=info.username, password=info.password)
    if info.certificate_path:
        user["client-certificate"] = str(info.certificate_path)
    elif info.certificate_data:
        user["client-certificate-data"] = _b64(info.certificate_data)
    if info.private_key_path:
        user["client-key"] = str(info.private_key_path)
    elif info.private_key_data:
        user["client-key-data"] = _b64(info.private_key_data)
    return KubeConfig.from_dict(
        {
            "current-context": "kopf",
            "clusters": [{"name": "kopf", "cluster": cluster}],
            "users": [{"name": "kopf", "user": user}],
            "contexts": [
                {
                    "name": "kopf",
                    "context": {"cluster": "kopf", "user": "kopf", "namespace": info.default_namespace or "default"},
                }
            ],
        }
    )


def _dict(obj: Any) -> Manifest:
    return obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)


def with_last_applied(manifest: Manifest) -> Manifest:
    """``manifest`` with its own JSON in the last-applied annotation (what the next apply diffs against)."""
    meta = dict(manifest["metadata"])
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != LAST_APPLIED}
    bare = {
        **manifest,
        "metadata": {**meta, "annotations": annotations}
        if annotations
        else {k: v for k, v in meta.items() if k != "annotations"},
    }
    annotations[LAST_APPLIED] = json.dumps(bare, sort_keys=True, separators=(",", ":"))
    return {**manifest, "metadata": {**meta, "annotations": annotations}}


class KubeApi:
    """Created once per operator; ``use`` is called by the login handler (also on re-login)."""

    def __init__(self) -> None:
        self._config: KubeConfig | None = None
        self._client: AsyncClient | None = None

    def use(self, info: kopf.ConnectionInfo) -> None:
        self._config = kubeconfig_from(info)
        self._stale, self._client = self._client, None  # the next request opens a client with the new credentials

    async def close(self) -> None:
        for client in (self._client, getattr(self, "_stale", None)):
            if client is not None:
                await client.close()
        self._client = self._stale = None

    def _api(self) -> AsyncClient:
        assert self._config is not None, "KubeApi used before the login handler ran"
        if self._client is None:
            self._client = AsyncClient(config=self._config, field_manager="moemesh-operator", trust_env=False)
        return self._client

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise KubeError(exc.status.code or 0, f"{what}: {exc.status.message}") from exc
        except httpx2.HTTPStatusError as exc:  # an error body that is not a Kubernetes Status
            if exc.response.status_code == 404:
                return None
            raise KubeError(exc.response.status_code, f"{what}: {exc.response.text[:200]}") from exc

    async def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        obj = await self._call(
            f"get {kind} {namespace}/{name}", self._api().get(RESOURCES[kind], name, namespace=namespace)
        )
        return None if obj is None else _dict(obj)

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Manifest]:
        """The objects of ``kind`` in ``namespace`` carrying every one of ``labels`` (the server
        selects them; the check here keeps servers that ignore labelSelector honest)."""

        async def collect() -> list[Any]:
            selector: dict[str, Any] = dict(labels)
            return [obj async for obj in self._api().list(RESOURCES[kind], namespace=namespace, labels=selector)]

        found = await self._call(f"list {kind} {namespace} {labels}", collect())
        objs = [_dict(obj) for obj in found or ()]
        return [obj for obj in objs if labels.items() <= ((obj.get("metadata") or {}).get("labels") or {}).items()]

    async def create(self, manifest: Manifest) -> Manifest:
        meta = manifest["metadata"]
        resource = RESOURCES[manifest["kind"]]
        obj = resource.from_dict(manifest) if hasattr(resource, "from_dict") else resource(manifest)
        created = await self._call(
            f"create {manifest['kind']} {meta['namespace']}/{meta['name']}",
            cast(Any, self._api()).create(obj, namespace=meta["namespace"]),
        )
        return _dict(created)

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Manifest, subresource: str | None = None
    ) -> Manifest | None:
        """JSON merge patch (RFC 7386: ``None`` removes a key, lists are replaced)."""
        resource = RESOURCES[kind]
        if subresource == "status":
            resource = resource.Status
        elif subresource is not None:
            raise ValueError(f"unsupported subresource {subresource!r}")
        obj = await self._call(
            f"patch {kind} {namespace}/{name}",
            self._api().patch(resource, name, patch, namespace=namespace, patch_type=PatchType.MERGE),
        )
        return None if obj is None else _dict(obj)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        await self._call(
            f"delete {kind} {namespace}/{name}", self._api().delete(RESOURCES[kind], name, namespace=namespace)
        )

    async def apply(self, manifest: Manifest) -> str:
        """Create or converge one object; returns 'created', 'patched' or 'unchanged'."""
        meta = manifest["metadata"]
        desired = with_last_applied(manifest)
        live = await self.get(manifest["kind"], meta["namespace"], meta["name"])
        if live is None:
            await self.create(desired)
            return "created"
        recorded = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
        last_applied = json.loads(recorded) if recorded else {}
        patch = merge_patch(desired, live, last_applied)
        if not patch:
            return "unchanged"
        version = (live.get("metadata") or {}).get("resourceVersion")
        if version:  # optimistic concurrency: 409 if someone wrote in between
            patch.setdefault("metadata", {})["resourceVersion"] = version
        await self.patch(manifest["kind"], meta["namespace"], meta["name"], patch)
        return "patched"

    async def secret_exists(self, namespace: str, name: str, key: str) -> bool | None:
        """Whether Secret ``name`` has ``key``; None when the operator may not read Secrets (403)."""
        try:
            secret = await self.get("Secret", namespace, name)
        except KubeError as exc:
            if exc.status == 403:
                return None
            raise
        if secret is None:
            return False
        return key in (secret.get("data") or {}) or key in (secret.get("stringData") or {})

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """A Secret's value; None when missing or when the operator may not read Secrets (403).

        Only a mesh's own ``spec.redis.passwordSecretRef`` is read this way (the chart's Redis
        password comes from the operator's environment), so ``get secrets`` stays optional."""
        try:
            secret = await self.get("Secret", namespace, name)
        except KubeError as exc:
            if exc.status == 403:
                return None
            raise
        data = (secret or {}).get("data") or {}
        return base64.b64decode(data[key]).decode() if key in data else None
