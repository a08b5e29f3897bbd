"""Two-rank torch.distributed groups for the torch-dist expert transport, and the framing of
messages on them.

A group is made directly from a c10d Store (no `init_process_group`, no global state), so one
process holds any number of them: an attention worker one per expert worker it calls, an expert
worker one per attention worker calling it. Rank 0 is the expert worker (it hosts the TCPStore),
rank 1 the attention worker. The store only serves the rendezvous; tensors go over the backend's
own connections (gloo: TCP pairs bound to each side's advertised host; nccl: the GPUs' links).

A message is one serialized protobuf: an int64 byte count, then the bytes as a uint8 tensor
(on the GPU for nccl). Requests travel on tags (0, 1), replies on (2, 3).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
EXPERT_RANK, ATTENTION_RANK = 0, 1
REQUEST_TAGS, REPLY_TAGS = (0, 1), (2, 3)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the expert side waits for requests as long as the peer lives


def first_line(e: Exception) -> str:
    """A backend error's first line (gloo's messages carry a long hint after it)."""
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def check_backend(backend: str) -> None:
    """ValueError unless this process can form `backend` groups (nccl needs a CUDA build with NCCL
    and a visible GPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"torch-dist backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ValueError(
            "torch-dist backend nccl needs a CUDA build of torch with NCCL and a GPU; this process has "
            f"torch {torch.__version__} and {torch.cuda.device_count()} GPUs (use gloo)"
        )


def device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def pair_group(store: dist.Store, rank: int, backend: str, host: str, timeout: datetime.timedelta):
    """Join the two-rank group on `store` (blocks until the peer joins, or raises after the store's
    timeout). `host` is the address the peer reaches this process at (gloo binds its pairs there).
    ValueError for a backend this process cannot form (`check_backend`)."""
    check_backend(backend)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, options)


class Framing:
    """Send and receive whole messages on a pair group (one caller at a time per direction)."""

    def __init__(self, group, peer: int, device: torch.device):
        self.group, self.peer, self.device = group, peer, device
        self._sending: list = []  # (work, tensors) of sends not yet known complete

    def send(self, data: bytes, tags: tuple[int, int]) -> None:
        """Starts the send and returns (gloo writes from its own thread); the tensors stay
        referenced until `reap` sees the work done."""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        works = [self.group.send([size], self.peer, tags[0])]
        payload = None
        if data:  # an all-default message serializes to no bytes: nothing follows its size
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            works.append(self.group.send([payload], self.peer, tags[1]))
        self._sending.append((works, size, payload))

    def reap(self) -> None:
        """Drop finished sends (waits for all of them: call it once a reply proves they arrived)."""
        for works, *_ in self._sending:
            for work in works:
                work.wait()
        self._sending.clear()

    def recv(self, tags: tuple[int, int], timeout: datetime.timedelta | None = None) -> bytes:
        """Raises RuntimeError when the peer is gone or `timeout` passes (the pair is then closed)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._wait(self.group.recv([size], self.peer, tags[0]), timeout)
        if int(size.item()) == 0:
            return b""
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self.group.recv([payload], self.peer, tags[1]), timeout)
        return payload.cpu().numpy().tobytes()

    @staticmethod
    def _wait(work, timeout: datetime.timedelta | None) -> None:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
