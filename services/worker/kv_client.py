"""`GrpcKVTransport`: the decode worker's side of a KV transfer over gRPC streaming.

One `Prefill` call per request: the prefill worker answers with a header (first token, sizes)
and the KV bytes in chunks (< 4 MiB each), written into one preallocated buffer. A timeout, a
broken stream or a short transfer raises KVTransferError; leaving early cancels the call, which
makes the prefill worker abort and free its blocks.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import torch

from moemesh.common.grpc_util import ChannelPool
from moemesh.engine.kv_transfer import KVTransferError, KVTransport, RemoteKV, RemotePrefillTask
from moemesh.proto.convert import layout_to_proto, logprob_from_proto
from moemesh.proto.v1 import prefill_pb2, prefill_pb2_grpc


class GrpcKVTransport(KVTransport):
    def __init__(self, channels: ChannelPool):
        self.channels = channels

    async def fetch(self, task: RemotePrefillTask) -> RemoteKV:
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
            return await asyncio.wait_for(self._receive(call, task), task.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise KVTransferError(f"prefill worker {task.endpoint}: {e.code().name}: {e.details()}") from e
        except TimeoutError as e:
            raise KVTransferError(f"prefill worker {task.endpoint}: no KV within {task.timeout_s} s") from e
        finally:
            call.cancel()  # no-op once the call completed

    async def _receive(self, call, task: RemotePrefillTask) -> RemoteKV:
        header = None
        buffer = view = None
        received = 0
        async for message in call:
            if message.HasField("header"):
                header = message.header
                expected = header.num_tokens * task.layout.bytes_per_token
                num_tokens = len(task.prompt_token_ids) - task.num_computed_tokens
                if header.num_tokens != num_tokens or header.num_bytes != expected:
                    raise KVTransferError(f"prefill worker sent {header.num_tokens} tokens / {header.num_bytes} bytes")
                buffer = torch.empty(header.num_bytes, dtype=torch.uint8)  # [num_bytes]
                view = buffer.numpy()
                continue
            if header is None:
                raise KVTransferError("KV chunk before the header")
            data = message.chunk.data
            offset = message.chunk.offset
            if offset + len(data) > len(view):
                raise KVTransferError("KV chunk past the end of the transfer")
            view[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            received += len(data)
        if header is None or received != header.num_bytes:
            raise KVTransferError(f"KV transfer ended early: {received} bytes received")
        first_logprob = logprob_from_proto(header.first_logprob) if header.HasField("first_logprob") else None
        return RemoteKV(header.first_token_id, first_logprob, header.num_tokens, header.num_cached_tokens, buffer)
