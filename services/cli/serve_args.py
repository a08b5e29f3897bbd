"""The `moemesh serve` command line: every role's flags in one parser (each role reads the ones
that apply to it: `moemesh.router.settings`, `moemesh.worker.settings`). The engine's flags are
generated from its one definition (`moemesh.runtime.engine_args`)."""

from __future__ import annotations

from moemesh.router.settings import add_router_arguments
from moemesh.runtime.engine_args import add_engine_arguments
from moemesh.runtime.settings import add_common_arguments
from moemesh.worker.settings import WORKER_ROLES, add_worker_arguments

ENGINE_GROUP = "engine (flag > the mesh config's roles.<role>.engine > its engine > default)"


def add_serve_arguments(parser) -> None:
    parser.add_argument("--role", required=True, choices=("router", *WORKER_ROLES))
    add_common_arguments(parser)
    add_engine_arguments(parser.add_argument_group(ENGINE_GROUP), "serve")
    add_worker_arguments(parser)
    add_router_arguments(parser)
