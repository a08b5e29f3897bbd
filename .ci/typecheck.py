"""mypy over the torch-free packages and the operator (`make typecheck`, part of `make test`).

mypy finds a package by its folder name, and pyproject maps `moemesh` to services/ (plus
`moemesh.kernels` to kernels/ and `moemesh.operator` to operator/). So this builds a tree named
`moemesh` of links to those folders in the cache directory and checks it there; mypy's own
settings are pyproject's [tool.mypy].
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

from mypy import api

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("text", "proto", "contracts", "runtime", "planning", "router", "operator")


def link_tree() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("MOEMESH_CACHE_DIR") or pathlib.Path.home() / ".cache" / "moemesh")
    base = cache / "mypy" / hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    tree = base / "moemesh"
    tree.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "services").iterdir() if p.name != "__pycache__"}
    wanted.update(kernels=ROOT / "kernels", operator=ROOT / "operator")
    for link in tree.iterdir():
        if link.name not in wanted or link.resolve() != wanted[link.name].resolve():
            link.unlink()
    for name, target in wanted.items():
        if not (tree / name).is_symlink():
            (tree / name).symlink_to(target)
    return base


def main() -> int:
    base = link_tree()
    os.chdir(base)
    args = [
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(base / ".mypy_cache"),
        "--python-executable",
        sys.executable,
    ]
    for package in PACKAGES:
        args += ["-p", f"moemesh.{package}"]
    out, err, status = api.run(args)
    sys.stdout.write(out.replace(str(base) + os.sep, ""))
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main())
