"""`moemesh up` starts Redis, a router and workers as processes, prints the URL, serves, restarts
what crashes (as a kubelet would), refuses a second cluster on its port before loading anything,
and a Ctrl-C (SIGINT to the process group, as a terminal sends it) stops every process it started."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import openai

from moemesh.launcher.local_cluster import free_port


def children_of(pid: int) -> set[int]:
    found, frontier = set(), {pid}
    while frontier:
        parents, frontier = frontier, set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in parents and int(entry) not in found:
                found.add(int(entry))
                frontier.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def interrupt_and_wait_gone(up: subprocess.Popen, processes: set[int]) -> None:
    """Ctrl-C to `moemesh up`'s process group: it exits 0 and every process it started is gone."""
    os.killpg(up.pid, signal.SIGINT)
    assert up.wait(120) == 0
    deadline = time.monotonic() + 60  # an upper bound on a loaded machine; the loop ends when all are gone
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in processes if alive(p)] == []


def test_moemesh_up_serves_restarts_what_crashes_and_ctrl_c_stops_everything(tmp_path):
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "moemesh.cli",
        "up",
        "--aggregated",
        "--decode",
        "1",
        "--port",
        str(port),
        "--kv-memory-gib",
        "0.05",
        "--num-threads",
        "1",
        "--log-dir",
        str(tmp_path),
    ]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = LineReader(up.stdout)
    try:
        line = output.next_line(timeout_s=600)
        assert re.match(rf"moemesh is up: OpenAI API at http://127\.0\.0\.1:{port}/v1 ", line), line
        processes = children_of(up.pid)
        assert len(processes) == 3  # redis-server, worker, router
        assert re.search(
            r"worker-0 +both +127\.0\.0\.1:\d+ +metrics http://127\.0\.0\.1:\d+/metrics",
            output.wait_for(lambda text: "worker-0" in text),
        )
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="Hello", max_tokens=3).choices[0].text

        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in second.stderr, second.stderr
        assert "moemesh is up" not in second.stdout

        worker, redis = (pid_with(processes, marker) for marker in ("--role both", "redis-server"))
        os.kill(worker, signal.SIGKILL)
        os.kill(redis, signal.SIGKILL)
        output.wait_for(lambda text: "worker-0 restarted (restart 1)" in text and "redis exited" in text)
        deadline = time.monotonic() + 300  # an upper bound: the restarted worker loads the model again
        while True:  # served again once the new worker registers and its channel reconnects
            try:
                assert client.completions.create(model=model, prompt="Hello", max_tokens=3).choices[0].text
                break
            except openai.APIStatusError as e:
                assert e.status_code == 503 and time.monotonic() < deadline, e
                time.sleep(0.5)
        interrupt_and_wait_gone(up, processes | children_of(up.pid))
        assert "moemesh: stopping" in output.wait_for(lambda text: "moemesh: stopping" in text)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


class LineReader:
    """A process's output lines, read on a thread so a test can wait for one with a bound."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        self.text = ""
        threading.Thread(target=lambda: [self.lines.put(line) for line in stream], daemon=True).start()

    def next_line(self, timeout_s: float = 300) -> str:
        line = self.lines.get(timeout=timeout_s)
        self.text += line
        return line

    def wait_for(self, predicate, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.text):
            self.next_line(max(deadline - time.monotonic(), 0.01))
        return self.text


def pid_with(pids: set[int], marker: str) -> int:
    (pid,) = [p for p in pids if marker in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
    return pid


def test_up_checks_engine_flags_before_starting_anything_and_hands_each_service_the_ones_its_role_reads():
    from moemesh.cli import build_parser
    from moemesh.launcher.up import ServiceArgs, service_args

    bad = subprocess.run(
        [sys.executable, "-m", "moemesh.cli", "up", "--speculative-method", "draft"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--speculative-method draft needs --draft-model" in bad.stderr
    assert service_args(build_parser().parse_args(["up"])) == ServiceArgs((), (), ())
    flags = [
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--dtype",
        "float32",
        "--block-size",
        "32",
    ]
    handed = service_args(build_parser().parse_args(["up", *flags]))
    speculation = ("--speculative-method", "ngram", "--num-speculative-tokens", "3")
    assert handed.worker == ("--dtype", "float32", "--block-size", "32", *speculation)
    assert (handed.expert, handed.router) == (("--dtype", "float32"), ("--block-size", "32"))
    worker = build_parser().parse_args(["serve", "--role", "decode", *handed.worker])  # the workers accept them
    assert worker.speculative_method == "ngram" and worker.num_speculative_tokens == 3 and worker.block_size == 32


def test_up_refuses_more_expert_replicas_than_expert_workers_before_starting_anything():
    bad = subprocess.run(
        [sys.executable, "-m", "moemesh.cli", "up", "--experts", "2", "--expert-replicas", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--expert-replicas 3 needs 1 <= replicas <= --experts (2)" in bad.stderr
