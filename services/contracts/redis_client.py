"""Redis clients of the services: short timeouts and a single quick retry, so an outage costs a
request at most a few milliseconds on loopback (callers then fall back; see the router's pool)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def connect(url: str, password: str | None = None, timeout_s: float = 1.0) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        health_check_interval=0,
    )
