"""API keys of the router (`--api-key`, or MOEMESH_API_KEY with several keys comma-separated),
checked on HTTP (`http_guard`) and gRPC (`grpc_api`) alike as `authorization: Bearer <key>`.

Each presented key is compared with every configured key by `hmac.compare_digest`, so neither the
time taken nor an early exit tells which key, or how much of one, matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

ENV_VAR = "MOEMESH_API_KEY"


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()):
        self._keys = [k.encode() for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """True when no key is configured, or `authorization` is `Bearer <a configured key>`."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        ok = False
        for key in self._keys:  # all compared, whatever matched
            ok |= hmac.compare_digest(given, key)
        return ok and scheme.lower() == "bearer"


def keys_from(flags: Iterable[str], env_value: str | None) -> tuple[str, ...]:
    """The `--api-key` flags plus the env's comma-separated keys, blanks dropped."""
    keys = [*flags, *(env_value or "").split(",")]
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))
