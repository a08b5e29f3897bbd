"""The HTTP API's outer boundary, one ASGI middleware in front of every route:

- API keys: with keys set, every path but the open ones (`/health`, `/live`, `/metrics`,
  `/version` by default) needs `Authorization: Bearer <key>` (`api_keys.ApiKeys`: constant-time
  comparison); a miss is an OpenAI-shaped 401.
- Body size: a body over `max_body_bytes` is a 413, refused from its Content-Length before a
  byte is read, or as soon as a chunked body passes the limit (bodies are read here, then handed
  to the route).
- Bugs: an exception that escapes a route becomes an OpenAI-shaped 500 for that response only;
  the connection stays open for the client's next request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from moemesh.router.api_keys import ApiKeys
from moemesh.runtime.settings import check

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/live", "/metrics", "/version")


@dataclass(frozen=True)
class GuardSettings:
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    open_paths: tuple[str, ...] = OPEN_PATHS  # served without a key
    max_body_bytes: int = 8 << 20

    def __post_init__(self):
        check(self.max_body_bytes > 0, f"max_body_bytes must be > 0, got {self.max_body_bytes}")


class HttpGuard:
    def __init__(self, app, settings: GuardSettings):
        self.app = app
        self.api_keys = ApiKeys(settings.api_keys)
        self.open_paths = frozenset(settings.open_paths)
        self.max_body_bytes = settings.max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] not in self.open_paths and not self.api_keys.allows(_header(scope, b"authorization")):
            return await _send_error(
                send,
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "invalid_request_error",
                "invalid_api_key",
                {"www-authenticate": "Bearer"},
            )
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, 413, self._too_large(int(length)), "invalid_request_error", None)
        body: bytes | None = b""
        if scope.get("method") in ("POST", "PUT", "PATCH"):  # read here, within the limit, then replayed
            body = await self._read_body(receive)
            if body is None:
                return await _send_error(
                    send, 413, self._too_large(self.max_body_bytes + 1), "invalid_request_error", None
                )
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: http.disconnect

        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception:
            logger.exception("%s %s failed", scope.get("method"), scope["path"])
            if not started:
                await _send_error(send, 500, "internal error (logged by the router)", "server_error", None)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected: the app sees an empty or partial body, then the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> str:
        return f"the request body has {size} bytes or more; this server accepts at most {self.max_body_bytes}"


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(
    send, status: int, message: str, error_type: str, code: str | None, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
