"""The expert worker's side of the torch-dist transport: a TCPStore for rendezvous and one
serving thread per two-rank group.

Callers: `ExpertServicer.OpenDataPlane` calls `open(session, backend)` (on a worker thread) when
an attention worker wants a group; `answer` is the servicer's `answer_blocking` (check, compute,
count on the serving thread itself: no hop per request; raises CallError for a refused request);
the worker calls `close()` at shutdown.

`open` starts the store on first use (an ephemeral port, returned to the caller, who reaches it at
the gRPC endpoint's host) and a thread that joins the group as rank 0, then loops: receive a
request, answer it, send the reply. The thread ends when the peer closes the group or dies
(the backend reports the closed connection); the next `OpenDataPlane` from that peer starts anew.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist
from google.protobuf.message import DecodeError

from moemesh.expert.protocol.call import CallError, ExpertReply, ExpertRequest, reply_to_proto, request_from_proto
from moemesh.expert.protocol.dist_group import (
    ATTENTION_RANK,
    EXPERT_RANK,
    IDLE_TIMEOUT,
    REPLY_TAGS,
    REQUEST_TAGS,
    Framing,
    check_backend,
    device_for,
    first_line,
    pair_group,
)
from moemesh.expert.protocol.wire import WireError
from moemesh.proto.v1 import expert_pb2

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=30)  # a peer that asked for a group must join within this


class DistDataPlane:
    def __init__(self, host: str, worker_id: str, answer: Callable[[ExpertRequest], ExpertReply]):
        self.host, self.worker_id, self._answer = host, worker_id, answer
        self._store: dist.TCPStore | None = None
        self._sessions: set[str] = set()
        self._lock = threading.Lock()

    def open(self, session: str, backend: str) -> int:
        """Start serving `session`; returns the store's port. ValueError for a bad request."""
        if not session:
            raise ValueError("OpenDataPlane needs a session name")
        check_backend(backend)  # before anything is started: a refused backend leaves no thread behind
        with self._lock:
            if session in self._sessions:
                raise ValueError(f"session {session!r} is already open")
            self._sessions.add(session)
            if self._store is None:
                self._store = dist.TCPStore(self.host, 0, None, True, RENDEZVOUS_TIMEOUT, wait_for_workers=False)
            store = self._store
        thread = threading.Thread(
            target=self._serve,
            args=(dist.PrefixStore(session, store), session, backend),
            name=f"moemesh-dist-{session[:8]}",
            daemon=True,
        )
        thread.start()
        return store.port

    def _serve(self, store: dist.Store, session: str, backend: str) -> None:
        try:
            group = pair_group(store, EXPERT_RANK, backend, self.host, IDLE_TIMEOUT)
        except RuntimeError as e:
            logger.warning("torch-dist session %s: the peer never joined (%s)", session[:8], first_line(e))
            return
        framing = Framing(group, ATTENTION_RANK, device_for(backend))
        logger.info("torch-dist session %s (%s) open", session[:8], backend)
        try:
            while True:
                try:
                    data = framing.recv(REQUEST_TAGS)
                except RuntimeError as e:  # the peer closed the group or died
                    logger.info("torch-dist session %s closed: %s", session[:8], first_line(e))
                    return
                reply = self._reply(data)
                framing.send(reply.SerializeToString(), REPLY_TAGS)
                framing.reap()
        except RuntimeError as e:
            logger.info("torch-dist session %s closed while replying: %s", session[:8], first_line(e))

    def _reply(self, data: bytes) -> expert_pb2.RunExpertsResponse:
        message = expert_pb2.RunExpertsRequest()
        try:
            message.ParseFromString(data)
        except DecodeError as e:
            return expert_pb2.RunExpertsResponse(error_code="INVALID_ARGUMENT", error=f"not a RunExpertsRequest: {e}")
        try:
            reply = reply_to_proto(self._answer(request_from_proto(message)))
        except WireError as e:
            reply = expert_pb2.RunExpertsResponse(error_code="INVALID_ARGUMENT", error=str(e))
        except CallError as e:
            reply = expert_pb2.RunExpertsResponse(error_code=e.code.name, error=str(e))
        except Exception as e:  # a bug: answer it as gRPC would (INTERNAL) and keep the group
            logger.exception("torch-dist request %d failed", message.sequence_id)
            reply = expert_pb2.RunExpertsResponse(error_code="INTERNAL", error=str(e))
        reply.sequence_id = message.sequence_id
        return reply

    def close(self) -> None:
        """Stop taking new groups (open ones end when their peer sees the process go)."""
        with self._lock:
            self._store = None
