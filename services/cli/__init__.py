"""`moemesh` command line.

moemesh generate "prompt"                 run the offline engine
moemesh serve --role ROLE [--config F]    run one service (router | prefill | decode | both | expert)
moemesh up [--experts N]                  run a local cluster: Redis, router, prefill, decode (and expert) workers
moemesh placement apply FILE              apply an expert placement (JSON) to a running mesh
moemesh plan --model DIR --gpu-memory M   how many expert pods a model needs, KV tokens per pod
"""

from __future__ import annotations

import argparse
import os
import sys

GENERATE_EXCLUDES = ("seed",)  # engine options `moemesh generate` spells otherwise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh", description="Serve Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="seed of each prompt's sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    from moemesh.runtime.engine_args import add_engine_arguments

    # LLM(...)'s options with its defaults; --seed above is the prompts' (the engine's seeds requests without one)
    add_engine_arguments(gen.add_argument_group("engine"), "offline", exclude=GENERATE_EXCLUDES)
    gen.set_defaults(func=_generate)

    from moemesh.cli.serve_args import add_serve_arguments
    from moemesh.launcher.up import add_up_arguments

    serve = sub.add_parser("serve", help="run one service: router, prefill, decode or both (aggregated worker)")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    up = sub.add_parser("up", help="run a local cluster on loopback (Redis, router, prefill + decode workers)")
    add_up_arguments(up)
    up.set_defaults(func=_up)
    fetch = sub.add_parser("fetch-model", help="download a mesh's hf model source into its cache (init container)")
    fetch.add_argument("--config", required=True, help="mesh config JSON with model.source")
    fetch.set_defaults(func=_fetch_model)
    from moemesh.cli.placement import add_placement_arguments

    placement = sub.add_parser("placement", help="expert placements: apply one to a running mesh (two-phase)")
    add_placement_arguments(placement)
    from moemesh.cli.plan import add_plan_arguments

    plan = sub.add_parser("plan", help="memory plan: pods a model needs, from config.json (reads no weights)")
    add_plan_arguments(plan)  # sets func=run_plan
    return parser


def _configure_logging(name: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")


def _serve(args) -> int:
    from moemesh.router.settings import router_settings
    from moemesh.runtime.settings import SettingsError
    from moemesh.text.errors import MoemeshError
    from moemesh.worker.settings import worker_settings

    try:
        if args.role == "router":
            from moemesh.router.main import main as router_main

            settings = router_settings(args)
            _configure_logging("router")
            return router_main(settings)
        settings = worker_settings(args)
        _configure_logging(settings.worker_id)
        if not settings.engine.device.startswith("cuda"):  # the torch references only: skip Triton's import
            os.environ.setdefault("MOEMESH_TRITON", "0")
        if settings.role == "expert":
            from moemesh.expert.server.main import main as serve
        else:
            from moemesh.worker.main import main as serve
        code = serve(settings)
    except (SettingsError, MoemeshError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    from moemesh.runtime.lifecycle import exit_process

    exit_process(code)  # stopped cleanly: skip the interpreter's teardown of torch and gRPC


def _fetch_model(args) -> int:
    """Exit 0 with the snapshot's path on stdout, or 1 with one line naming the source."""
    from moemesh.runtime.model_source_resolver import ModelSourceError, fetch_model
    from moemesh.runtime.settings import SettingsError, read_config_file

    try:
        source = (read_config_file(args.config).get("model") or {}).get("source")
        if source is None:
            raise ModelSourceError(f"mesh config {args.config!r} has no model.source")
        print(fetch_model(source), flush=True)
    except (SettingsError, ModelSourceError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 1
    return 0


def _up(args) -> int:
    from moemesh.launcher.up import run_up

    return run_up(args)


def _generate(args) -> int:
    from moemesh.engine.errors import MoemeshError
    from moemesh.engine.sampling_params import SamplingParams
    from moemesh.runtime.engine_args import from_flags, options_for
    from moemesh.runtime.engine_config import options_of
    from moemesh.runtime.settings import SettingsError

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
        )
        config = from_flags(args, GENERATE_EXCLUDES)  # checked here, errors naming the flags
        values = options_of(config)
        options = {o.name: values[o.name] for o in options_for(GENERATE_EXCLUDES) if o.group != "spec"}
        from moemesh.engine.llm import LLM  # torch: only once the arguments are known good

        llm = LLM(speculative=config.spec, **options)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except (SettingsError, MoemeshError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompt, outputs):
        if len(args.prompt) > 1:
            print(f"--- {prompt!r}")
        print(output.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
