"""Building and loading the project's C kernels (kernels/csrc/: group_gemv.c, cpu_ops.c with
paged_attention.c, llama_decode.c with paged_attention.c, cpu_moe.c, moe_dispatch.c) on the machine
that runs them.

Each library is compiled from its sources with the system C compiler ($CC, else `cc` / `gcc`) for
this machine (-march=native; tests also build AVX2-only and scalar copies), warnings as errors,
into a cache directory keyed by the sources, csrc's headers, the compiler, the flags and the CPU's
flags ($MOEMESH_CACHE_DIR, else ~/.cache/moemesh). No compiler, or a failed build:
`compile_library` returns None (logged) and the callers use their torch paths instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the C sources and their shared headers (simd.h, c_parts.h, ...)
NATIVE_FLAGS = ("-march=native",)
# -ffp-contract=off: no fused multiply-adds unless written (the kernels round where torch does);
# -pthread: llama_decode.c starts a GEMV helper thread; warnings are errors, so that a kernel
# with one never ships (its callers take the torch path, logged)
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra", "-Werror")
# the NAME_parts entry points split a call over torch's OpenMP threads (c_parts.h); a compiler
# without OpenMP builds them serial
OPENMP_FLAGS = ("-fopenmp",)


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


def compile_library(
    sources: Path | Sequence[Path],  # one library's C files; the first names it
    target_flags: tuple[str, ...],
    fallback: str,
) -> ctypes.CDLL | None:
    """`sources` built into one library with `target_flags` and loaded, or None (logged, naming
    `fallback`: what the callers do instead) where no compiler is found or the build fails."""
    files = [sources] if isinstance(sources, Path) else list(sources)
    name = files[0].name
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler for %s: %s", name, fallback)
        return None
    headers = sorted(CSRC.glob("*.h"))  # what the sources include: a changed header is a new build
    for extra in (OPENMP_FLAGS, ()):
        flags = [*BASE_FLAGS, *extra, *target_flags]
        inputs = [*files, *headers]
        parts = [*(f.read_bytes() for f in inputs), compiler.encode(), " ".join(flags).encode(), cpu_flags().encode()]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
        path = cache_dir() / f"{files[0].stem}-{key}.so"
        try:
            if not path.exists():
                _compile(compiler, flags, files, path)
            return ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
            then = "trying without OpenMP" if extra else fallback
            log.warning("building %s with %s failed (%s): %s", name, " ".join(flags), then, detail)
    return None


def _compile(compiler: str, flags: list[str], sources: list[Path], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        command = [compiler, *flags, *map(str, sources), "-o", str(built), "-lm"]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(built, path)  # atomic: processes building at once each install a whole file


def declare_parts(lib: ctypes.CDLL, name: str, begin_index: int) -> None:
    """Argument and return types of NAME_parts (c_parts.h) from NAME's, declared first: NAME's
    (begin, end) at `begin_index` become (bounds, parts)."""
    fn, parts_fn, i64 = getattr(lib, name), getattr(lib, f"{name}_parts"), ctypes.c_int64
    parts_fn.argtypes = [*fn.argtypes[:begin_index], ctypes.POINTER(i64), i64, *fn.argtypes[begin_index + 2 :]]
    parts_fn.restype = fn.restype


def run_parts(lib: ctypes.CDLL, name: str, args: tuple, tail: tuple, parts: list[tuple[int, int]]) -> int:
    """NAME(*args, begin, end, *tail) for each part, all at once on torch's OpenMP threads through
    NAME_parts (one part: NAME itself, here); the smallest return code (0: every part ran)."""
    if len(parts) == 1:
        return getattr(lib, name)(*args, *parts[0], *tail)
    bounds = (ctypes.c_int64 * (len(parts) + 1))(*(begin for begin, _ in parts), parts[-1][1])
    return getattr(lib, f"{name}_parts")(*args, bounds, len(parts), *tail)
