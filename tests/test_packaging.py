"""Packaging: every package folder is listed in pyproject's explicit `packages`, and the files read at run
time ship as package data (a wheel would miss them otherwise)."""

import fnmatch
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)) if relative else name)
    assert found - listed == set(), "add these to [tool.setuptools] packages"


def test_c_sources_and_headers_ship_as_package_data():
    """The C kernels are compiled where they run (kernels/c_library.py), from the installed files: a
    source or header missing from a wheel (a Docker image's `pip install .`) leaves the torch paths."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = config["package-data"]
    for name, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".c", ".h") or "__pycache__" in path.parts:
                continue
            # the nearest listed package holds it (kernels/csrc/ is a data folder of moemesh.kernels)
            parts = path.parent.relative_to(ROOT / folder).parts
            depth = max(d for d in range(len(parts) + 1) if ".".join((name, *parts[:d])) in config["packages"])
            package = ".".join((name, *parts[:depth]))
            relative = pathlib.PurePosixPath(*parts[depth:], path.name)
            globs = [pathlib.PurePosixPath(g) for g in data.get(package, [])]  # setuptools' globs stop at a "/"
            assert any(g.parent == relative.parent and fnmatch.fnmatch(path.name, g.name) for g in globs), (
                f"{relative}: add it to {package}'s package-data"
            )
