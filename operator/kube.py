"""A small async Kubernetes API client for the operator's children (aiohttp, no extra deps).

It reuses the credentials kopf's login produced (``kopf.ConnectionInfo``), so the operator logs
in once. Only what reconciliation needs: get, create, merge-patch, delete, and an idempotent
``apply`` that patches only when the live object differs from the desired one.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from typing import Any

import aiohttp
import kopf

Manifest = dict[str, Any]

# kind -> (API prefix, plural); namespaced kinds only.
RESOURCES = {
    "ConfigMap": ("api/v1", "configmaps"),
    "Secret": ("api/v1", "secrets"),
    "Service": ("api/v1", "services"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "StatefulSet": ("apis/apps/v1", "statefulsets"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API error {status}: {message}")
        self.status = status


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field of ``desired`` is present and equal in ``live`` (server defaults ignored)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    return desired == live


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context()
    if info.ca_path:
        context.load_verify_locations(cafile=info.ca_path)
    elif info.ca_data:
        data = info.ca_data.encode() if isinstance(info.ca_data, str) else info.ca_data
        context.load_verify_locations(cadata=base64.b64decode(data).decode())
    cert, key = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        with tempfile.NamedTemporaryFile(delete=False) as cert_file, tempfile.NamedTemporaryFile(delete=False) as key_file:
            cert_file.write(base64.b64decode(info.certificate_data))
            key_file.write(base64.b64decode(info.private_key_data))
        cert, key = cert_file.name, key_file.name
    if cert and key:
        context.load_cert_chain(certfile=cert, keyfile=key)
    return context


class KubeApi:
    """Created once per operator; ``use`` is called by the login handler (also on re-login)."""

    def __init__(self) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    def use(self, info: kopf.ConnectionInfo) -> None:
        self._info = info
        self._session = None  # the next request opens a session with the new credentials

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        assert self._info is not None, "KubeApi used before the login handler ran"
        prefix, plural = RESOURCES[kind]
        url = f"{self._info.server.rstrip('/')}/{prefix}/namespaces/{namespace}/{plural}"
        if name:
            url += f"/{name}"
        if subresource:
            url += f"/{subresource}"
        return url

    async def _request(self, method: str, url: str, body: Any = None, content_type: str = "application/json") -> Any:
        assert self._info is not None, "KubeApi used before the login handler ran"
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=_ssl_context(self._info))
            self._session = aiohttp.ClientSession(connector=connector, headers=self._info.as_http_headers())
        headers = {"Content-Type": content_type}
        async with self._session.request(method, url, json=body, headers=headers) as response:
            payload = await response.json(content_type=None) if response.content_length != 0 else None
            if response.status == 404:
                return None
            if response.status >= 400:
                message = payload.get("message") if isinstance(payload, dict) else str(payload)
                raise KubeError(response.status, f"{method} {url}: {message}")
            return payload

    async def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        return await self._request("GET", self._url(kind, namespace, name))

    async def create(self, manifest: Manifest) -> Manifest:
        meta = manifest["metadata"]
        return await self._request("POST", self._url(manifest["kind"], meta["namespace"]), manifest)

    async def patch(self, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest | None:
        url = self._url(kind, namespace, name)
        return await self._request("PATCH", url, patch, content_type="application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        await self._request("DELETE", self._url(kind, namespace, name))

    async def apply(self, manifest: Manifest) -> str:
        """Create or converge one object; returns 'created', 'patched' or 'unchanged'."""
        meta = manifest["metadata"]
        live = await self.get(manifest["kind"], meta["namespace"], meta["name"])
        if live is None:
            await self.create(manifest)
            return "created"
        if is_subset(manifest, live):
            return "unchanged"
        await self.patch(manifest["kind"], meta["namespace"], meta["name"], manifest)
        return "patched"

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        secret = await self.get("Secret", namespace, name)
        data = (secret or {}).get("data") or {}
        return base64.b64decode(data[key]).decode() if key in data else None
