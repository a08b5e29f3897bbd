"""The process lifecycle every service uses: run until SIGTERM / SIGINT, or until the launcher
that started the process is gone."""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import sys
from typing import NoReturn


async def watch_parent(parent_pid: int | None, stop, interval_s: float = 1.0) -> None:
    """Set `stop` (an asyncio.Event) once the launcher that started this process is gone."""
    if parent_pid is None:
        return
    while os.getppid() == parent_pid:
        await asyncio.sleep(interval_s)
    stop.set()


def serve_until_signalled(serve, parent_pid: int | None) -> int:
    """Run `serve(stop)` (a coroutine function taking an asyncio.Event) until SIGTERM / SIGINT,
    or until the launcher `parent_pid` is gone; a worker process's main loop. Returns the exit
    status `serve` returns (None: 0)."""

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watchdog = asyncio.create_task(watch_parent(parent_pid, stop))
        code = await serve(stop)
        watchdog.cancel()
        return code or 0

    return asyncio.run(run())


def exit_process(code: int) -> NoReturn:
    """End a service process that has shut down cleanly (servers stopped, engine stopped, clients
    closed) without the interpreter's teardown: the atexit handlers still run (log and trace
    exporters flush), the final garbage collection of torch and gRPC objects does not. That
    collection alone kept a stopped worker alive for 2-7 s, which a pod's termination and every
    scale-down would wait on."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
