"""`GrpcKVTransport`: the decode worker's side of a KV transfer over gRPC streaming.

One `Prefill` call per request: the prefill worker streams the KV as its chunked prefill
progresses (KVChunks of whole tokens, < 4 MiB each), then the first token (PrefillDone). Each
chunk is yielded as it arrives, so a transfer that breaks later leaves the caller what came
before. No message for `idle_timeout_s`, the call's deadline (`timeout_s`), or a broken stream
raises KVTransferError; leaving early cancels the call, which makes the prefill worker abort and
free its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import torch

from moemesh.engine.connectors.base import FirstToken
from moemesh.engine.connectors.kv_transfer import KVPiece, KVTransferError, KVTransport, RemotePrefillTask
from moemesh.proto.v1 import prefill_pb2, prefill_pb2_grpc
from moemesh.runtime.grpc_util import ChannelPool
from moemesh.worker.convert import layout_to_proto, logprob_from_proto


class GrpcKVTransport(KVTransport):
    def __init__(self, channels: ChannelPool):
        self.channels = channels

    async def fetch(self, task: RemotePrefillTask) -> AsyncIterator[KVPiece | FirstToken]:
        stub = prefill_pb2_grpc.PrefillWorkerStub(self.channels.get(task.endpoint))
        request = prefill_pb2.PrefillRequest(
            request_id=task.request_id,
            prompt_token_ids=task.prompt_token_ids,
            sampling=task.sampling,
            num_computed_tokens=task.num_computed_tokens,
            layout=layout_to_proto(task.layout),
        )
        call = stub.Prefill(request, metadata=task.metadata, timeout=task.timeout_s)
        try:
            while True:
                try:
                    message = await asyncio.wait_for(call.read(), task.idle_timeout_s)
                except TimeoutError as e:
                    raise KVTransferError(f"prefill worker {task.endpoint}: nothing for {task.idle_timeout_s} s") from e
                if message is grpc.aio.EOF:
                    raise KVTransferError(f"prefill worker {task.endpoint}: the stream ended before the first token")
                if message.HasField("done"):
                    yield _first_token(message.done)
                    return
                chunk = message.chunk
                if not chunk.data:
                    raise KVTransferError(f"prefill worker {task.endpoint}: an empty KV chunk")
                data = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)  # [num_bytes]
                yield KVPiece(chunk.start_token, chunk.num_tokens, data)
        except grpc.aio.AioRpcError as e:
            raise KVTransferError(f"prefill worker {task.endpoint}: {e.code().name}: {e.details()}") from e
        finally:
            call.cancel()  # no-op once the call completed


def _first_token(done: prefill_pb2.PrefillDone) -> FirstToken:
    logprob = logprob_from_proto(done.first_logprob) if done.HasField("first_logprob") else None
    return FirstToken(done.first_token_id, logprob, done.num_cached_tokens)
