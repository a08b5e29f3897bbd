"""Operator configuration: the only place that reads environment variables.

MOEMESH_REDIS_URL            default Redis of meshes without spec.redis.url
                             (the chart's managed Redis)
MOEMESH_REDIS_PASSWORD       its password (the chart injects it from the Redis Secret)
MOEMESH_REDIS_SECRET_NAME    Secret/key that worker pods of such meshes read the password from
MOEMESH_REDIS_SECRET_KEY
MOEMESH_TICK_SECONDS         how often the telemetry timer runs per mesh (default 15)
MOEMESH_DEFAULT_IMAGE        services image when spec.image is not set
MOEMESH_WATCH_NAMESPACE      read by the image's entrypoint, not here: set, the operator runs
                             ``kopf run --namespace=NS`` (namespaced RBAC); empty, ``--all-namespaces``
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    redis_url: str = "redis://moemesh-redis:6379/0"
    redis_password: str | None = None
    redis_secret_name: str | None = None
    redis_secret_key: str = "redis-password"
    tick_seconds: float = 15.0
    default_image: str = "moemesh/moemesh-services:0.1.0"

    def __post_init__(self) -> None:
        if self.tick_seconds <= 0:
            raise ValueError(f"MOEMESH_TICK_SECONDS must be > 0, got {self.tick_seconds}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"MOEMESH_REDIS_URL must be a redis://, rediss:// or unix:// URL, got {self.redis_url!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            redis_url=env.get("MOEMESH_REDIS_URL", defaults.redis_url),
            redis_password=env.get("MOEMESH_REDIS_PASSWORD") or None,
            redis_secret_name=env.get("MOEMESH_REDIS_SECRET_NAME") or None,
            redis_secret_key=env.get("MOEMESH_REDIS_SECRET_KEY", defaults.redis_secret_key),
            tick_seconds=float(env.get("MOEMESH_TICK_SECONDS", defaults.tick_seconds)),
            default_image=env.get("MOEMESH_DEFAULT_IMAGE", defaults.default_image),
        )
