"""`moemesh placement apply FILE`: apply an expert placement (Placement JSON, see placement.py;
its version is replaced by the next free one) to a running mesh, two-phase, and wait until it
is active. Bad input (unreadable file, invalid placement, workers not running, wrong shape)
prints the reason and exits with status 2, changing nothing; a timeout exits with status 1."""

from __future__ import annotations

import sys

import redis


def add_placement_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="placement_command", required=True)
    apply = sub.add_parser("apply", help="publish a placement, wait for the expert workers, activate it")
    apply.add_argument("file", help="placement JSON: num_experts, worker_ids, slot_owner, phy2log")
    apply.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    apply.add_argument("--mesh", default="local")
    apply.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the workers (default 120)")
    apply.set_defaults(func=run_apply)


def run_apply(args) -> int:
    from moemesh.contracts.placement import Placement, PlacementError
    from moemesh.contracts.placement_apply import PlacementTimeoutError, apply_placement
    from moemesh.contracts.redis_client import connect

    try:
        with open(args.file) as f:
            placement = Placement.from_json(f.read())
    except (OSError, PlacementError) as e:
        print(f"moemesh: error: cannot use placement {args.file!r}: {e}", file=sys.stderr)
        return 2
    client = connect(args.redis_url)
    try:
        applied = apply_placement(client, args.mesh, placement, timeout_s=args.timeout)
    except PlacementTimeoutError as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 1
    except PlacementError as e:
        print(f"moemesh: error: placement rejected: {e}", file=sys.stderr)
        return 2
    except redis.RedisError as e:
        print(f"moemesh: error: Redis at {args.redis_url}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"placement {applied.version} is active on {len(applied.worker_ids)} expert workers")
    return 0
