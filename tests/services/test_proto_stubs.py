"""The checked-in gRPC stubs match proto/, and nothing crosses processes as pickle."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_equal_freshly_generated_ones(tmp_path):
    generator = load_generator()
    fresh = {p.name: p.read_text() for p in generator.generate(tmp_path / "v1")}
    checked_in = {p.name: p.read_text() for p in generator.STUB_DIR.iterdir() if p.is_file()}
    assert set(fresh) == set(checked_in), "stub files differ from proto/; run: python proto/generate.py"
    stale = sorted(name for name in fresh if fresh[name] != checked_in[name])
    assert not stale, f"stale stubs {stale}; run: python proto/generate.py"


def test_every_proto_file_has_stubs():
    generator = load_generator()
    names = {p.stem for p in generator.PROTO_FILES}
    assert names == {"common", "decode", "expert", "generate", "prefill", "telemetry"}
    for name in names:
        assert (generator.STUB_DIR / f"{name}_pb2.py").exists()


def test_no_pickle_in_the_services():
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "services").rglob("*.py")
        if re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", path.read_text(), re.MULTILINE)
    ]
    assert offenders == []


def test_kv_chunks_fit_well_under_the_grpc_message_limit():
    from moemesh.worker.settings import WorkerSettings

    assert WorkerSettings(role="decode", worker_id="d").kv_chunk_bytes <= 2 << 20
