"""Regenerate the Python stubs of proto/moemesh/v1/*.proto into services/proto/v1/ (= moemesh.proto.v1).

    python proto/generate.py            # write the checked-in stubs
    python proto/generate.py --out DIR  # write them elsewhere (the staleness test does this)

protoc names imports after the proto package (`from moemesh.v1 import ...`); the stubs live in
`moemesh.proto.v1`, so those imports are rewritten. Needs grpcio-tools (a test dependency).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
STUB_DIR = REPO_ROOT / "services" / "proto" / "v1"
PROTO_FILES = sorted((PROTO_ROOT / "moemesh" / "v1").glob("*.proto"))
_IMPORT = re.compile(r"^from moemesh\.v1 import ", re.MULTILINE)
_INIT = '"""Generated gRPC/protobuf stubs of proto/moemesh/v1 (regenerate: python proto/generate.py)."""\n'


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs (+ __init__.py) into out_dir; returns the files written."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{pathlib.Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *[str(p) for p in PROTO_FILES],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((pathlib.Path(raw) / "moemesh" / "v1").iterdir()):
            dst = out_dir / src.name
            dst.write_text(_IMPORT.sub("from moemesh.proto.v1 import ", src.read_text()))
            written.append(dst)
    (out_dir / "__init__.py").write_text(_INIT)
    parent_init = out_dir.parent / "__init__.py"
    if not parent_init.exists():
        parent_init.write_text('"""gRPC contracts (generated from proto/)."""\n')
    return written + [out_dir / "__init__.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=STUB_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
