"""`moemesh up --experts 2 --expert-transport torch-dist --model DIR` on a tiny random DeepSeek-V3
checkpoint (MLA + grouped routing + a shared expert) stored in block FP8 as the released
checkpoints are: Redis, two expert workers with an even placement serving float8 experts, an
aggregated worker using them over gloo groups, and a router; greedy outputs equal the in-process
engine with local experts and Hugging Face `generate` on the fp32 dequantization; Ctrl-C stops
every process. (The bf16 DeepSeek-V3 through expert workers: test_transports.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

from moemesh.engine.sampling_params import SamplingParams
from moemesh.launcher.local_cluster import free_port
from tests.services.test_up import children_of, interrupt_and_wait_gone

from .conftest import hf_generate, local_engine
from .expert_helpers import MAX_NEW, generate_all


def test_moemesh_up_with_two_expert_workers_serves_fp8_deepseek_v3_like_local_experts_and_hugging_face(
    fp8_deepseek, prompts, tmp_path
):
    path, hf = fp8_deepseek
    command = [
        sys.executable,
        "-m",
        "moemesh.cli",
        "up",
        "--aggregated",
        "--experts",
        "2",
        "--model",
        path,
        "--expert-transport",
        "torch-dist",
        "--port",
        str(free_port()),
        "--kv-memory-gib",
        "0.02",
        "--dtype",
        "float32",
        "--num-threads",
        "1",
        "--log-dir",
        str(tmp_path),
    ]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line = up.stdout.readline()
        match = re.match(r"moemesh is up: .* \(gRPC Generate at (127\.0\.0\.1:\d+)\)", line)
        assert match, line + "".join(open(p).read()[-2000:] for p in tmp_path.glob("*.log"))
        processes = children_of(up.pid)
        assert len(processes) == 5  # redis-server, 2 expert workers, worker, router
        assert sorted(p.name for p in tmp_path.glob("*.log")) == [
            "local-expert-0.log",
            "local-expert-1.log",
            "router.log",
            "worker-0.log",
        ]
        ours = generate_all(SimpleNamespace(grpc_endpoint=match.group(1)), prompts)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        assert ours == [o.token_ids for o in local_engine(path).generate(prompts, greedy)]
        assert ours == hf_generate(hf, prompts, MAX_NEW)
        interrupt_and_wait_gone(up, processes)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
