"""Building and loading the project's C kernels (group_gemv.c, cpu_ops.c) on the machine that runs them.

Each source is compiled with the system C compiler ($CC, else `cc` / `gcc`) for this machine
(-march=native; tests also build AVX2-only and scalar copies) into a cache directory keyed by the
source, the compiler, the flags and the CPU's flags ($MOEMESH_CACHE_DIR, else ~/.cache/moemesh).
No compiler, or a failed build: `compile_library` returns None (logged) and the callers use their
torch paths instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

NATIVE_FLAGS = ("-march=native",)
# -ffp-contract=off: no fused multiply-adds unless written (the kernels round where torch does);
# -pthread: cpu_ops.c starts a GEMV helper thread
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off", "-pthread")


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("MOEMESH_CACHE_DIR") or Path.home() / ".cache" / "moemesh"
    return Path(root) / "kernels"


def compile_library(source: Path, target_flags: tuple[str, ...], fallback: str) -> ctypes.CDLL | None:
    """`source` built with `target_flags` and loaded, or None (logged, naming `fallback`: what the
    callers do instead) where no compiler is found or the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler for %s: %s", source.name, fallback)
        return None
    flags = [*BASE_FLAGS, *target_flags]
    parts = [source.read_bytes(), compiler.encode(), " ".join(flags).encode(), cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = cache_dir() / f"{source.stem}-{key}.so"
    if not path.exists():
        try:
            _compile(compiler, flags, source, path)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
            log.warning("building %s failed (%s): %s", source.name, fallback, detail)
            return None
    return ctypes.CDLL(str(path))


def _compile(compiler: str, flags: list[str], source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], capture_output=True, text=True,
                       check=True)  # fmt: skip
        os.replace(built, path)  # atomic: processes building at once each install a whole file


def run_parts(fn, args: tuple, tail: tuple, parts: list[tuple[int, int]]) -> list[int]:
    """fn(*args, begin, end, *tail) for each part, the first on this thread and the rest on a pool
    (ctypes releases the GIL, so they run at once); the return codes, in order."""
    futures = [_pool(len(parts) - 1).submit(fn, *args, *p, *tail) for p in parts[1:]]
    return [fn(*args, *parts[0], *tail)] + [f.result() for f in futures]


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor | None:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moemesh-c") if workers else None
