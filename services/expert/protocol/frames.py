"""The socket transport's frames: an ExpertRequest or ExpertReply as a fixed little-endian header
followed by the raw bytes of its arrays (no protobuf, no per-element encoding).

Request: REQUEST header (magic b"MMq1", sequence id, layer, placement version, hidden-state dtype
code, whether entry weights follow, outputs_in_input_dtype, num_tokens, hidden, num_groups,
num_entries), then
hidden_states [num_tokens, hidden] in that dtype, group_slots, group_experts and group_rows
(int32 [num_groups] each), row_ids (int32 [num_entries]) and, when flagged, entry_weights
(float32 [num_entries]).
Reply: REPLY header (magic b"MMp1", sequence id, status: 0 or a gRPC status code number, outputs
dtype code, compute_s, rows, cols, error byte count), then outputs [rows, cols] (status 0) or the
error message in UTF-8.

A header that does not parse (wrong magic, unknown dtype, negative or oversized counts) raises
FrameError: the stream cannot be resynchronised, so the reader closes the connection.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from typing import NamedTuple

import grpc
import numpy as np
import torch

from moemesh.expert.protocol.call import ExpertReply, ExpertRequest

REQUEST = struct.Struct("<4sQiqBBBxiiii")
REPLY = struct.Struct("<4sQBB2xdiiI")
REQUEST_MAGIC, REPLY_MAGIC = b"MMq1", b"MMp1"
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_PAYLOAD_BYTES = 1 << 31  # a header announcing more is refused (it is corrupt or hostile)
STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


class FrameError(ValueError):
    """Bytes that are not a frame of this protocol; the connection must be closed."""


class RequestHeader(NamedTuple):  # a tuple: built on every frame's cold path, cheaper than a dataclass
    sequence_id: int
    layer: int
    placement_version: int
    dtype: torch.dtype
    has_weights: bool
    outputs_in_input_dtype: bool
    num_tokens: int
    hidden: int
    num_groups: int
    num_entries: int

    @property
    def payload_bytes(self) -> int:
        return (
            self.num_tokens * self.hidden * self.dtype.itemsize
            + 4 * (3 * self.num_groups + self.num_entries)
            + 4 * self.num_entries * self.has_weights
        )


class ReplyHeader(NamedTuple):
    sequence_id: int
    status: int  # 0 = OK, else a grpc.StatusCode number
    dtype: torch.dtype
    compute_s: float
    rows: int
    cols: int
    error_bytes: int

    @property
    def payload_bytes(self) -> int:
        if self.status:
            return self.error_bytes
        return self.rows * self.cols * self.dtype.itemsize


def _dtype(code: int) -> torch.dtype:
    dtype = CODE_DTYPES.get(code)
    if dtype is None:
        raise FrameError(f"unknown dtype code {code}")
    return dtype


@functools.lru_cache(maxsize=256)
def _byte_array(size: int) -> type:
    return ctypes.c_char * size


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes (a dense copy first if it is not contiguous), without a copy and without
    torch ops (each costs ~10 us from the cold caches of the dispatch path); the view keeps the
    tensor alive."""
    if not tensor.is_cpu:
        raise ValueError(f"a {tensor.device} tensor cannot be framed; move it to the CPU first")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    size = tensor.nbytes
    if not size:
        return memoryview(b"")
    array = _byte_array(size).from_address(tensor.data_ptr())
    array.owner = tensor
    return memoryview(array)


def encode_request(sequence_id: int, request: ExpertRequest) -> list:
    """The frame as a list of buffers (for socket.sendmsg)."""
    x, weights = request.hidden_states, request.entry_weights
    if x.dtype not in DTYPE_CODES:
        raise ValueError(f"hidden_states of dtype {x.dtype} cannot be sent; use one of {list(DTYPE_CODES)}")
    arrays = [
        np.ascontiguousarray(a, dtype="<i4")
        for a in (request.group_slots, request.group_experts, request.group_rows, request.row_ids)
    ]
    header = REQUEST.pack(
        REQUEST_MAGIC,
        sequence_id,
        request.layer,
        request.placement_version,
        DTYPE_CODES[x.dtype],
        weights is not None,
        request.outputs_in_input_dtype,
        x.shape[0],
        x.shape[1],
        arrays[0].size,
        arrays[3].size,
    )
    buffers = [header, _bytes_of(x), *(memoryview(a) for a in arrays)]
    if weights is not None:
        buffers.append(_bytes_of(weights.float()))
    return buffers


def parse_request_header(data: bytes | bytearray) -> RequestHeader:
    magic, seq, layer, version, dtype_code, has_weights, in_input_dtype, *sizes = REQUEST.unpack(data)
    if magic != REQUEST_MAGIC:
        raise FrameError(f"not a request frame (magic {magic!r})")
    header = RequestHeader(seq, layer, version, _dtype(dtype_code), bool(has_weights), bool(in_input_dtype), *sizes)
    if min(sizes) < 0 or header.payload_bytes > MAX_PAYLOAD_BYTES:
        raise FrameError(f"request {seq} announces sizes {sizes} (at most {MAX_PAYLOAD_BYTES} payload bytes)")
    return header


def decode_request(header: RequestHeader, payload: bytearray) -> ExpertRequest:
    """The request over `payload` (its tensors and arrays are views of it: no copy)."""
    x_bytes = header.num_tokens * header.hidden * header.dtype.itemsize
    if header.num_tokens * header.hidden:
        x = torch.frombuffer(payload, dtype=header.dtype, count=header.num_tokens * header.hidden)
        x = x.view(header.num_tokens, header.hidden)
    else:
        x = torch.empty(header.num_tokens, header.hidden, dtype=header.dtype)
    offset, arrays = x_bytes, []
    for count in (header.num_groups, header.num_groups, header.num_groups, header.num_entries):
        arrays.append(np.frombuffer(payload, dtype="<i4", count=count, offset=offset))
        offset += 4 * count
    weights = None
    if header.has_weights:
        weights = torch.from_numpy(np.frombuffer(payload, dtype="<f4", count=header.num_entries, offset=offset).copy())
    return ExpertRequest(header.layer, header.placement_version, x, *arrays, weights, header.outputs_in_input_dtype)


def encode_reply(sequence_id: int, reply: ExpertReply) -> list:
    y = reply.outputs
    if y.dtype not in DTYPE_CODES or y.dim() != 2:
        raise ValueError(f"outputs must be a 2-d tensor of one of {list(DTYPE_CODES)}, got {y.dtype} {list(y.shape)}")
    header = REPLY.pack(REPLY_MAGIC, sequence_id, 0, DTYPE_CODES[y.dtype], reply.compute_s, y.shape[0], y.shape[1], 0)
    return [header, _bytes_of(y)]


def encode_error(sequence_id: int, code: grpc.StatusCode, message: str) -> list:
    text = message.encode()[:65536]
    return [REPLY.pack(REPLY_MAGIC, sequence_id, code.value[0], DTYPE_CODES[torch.float32], 0.0, 0, 0, len(text)), text]


def parse_reply_header(data: bytes | bytearray) -> ReplyHeader:
    magic, seq, status, dtype_code, compute_s, rows, cols, error_bytes = REPLY.unpack(data)
    if magic != REPLY_MAGIC:
        raise FrameError(f"not a reply frame (magic {magic!r})")
    if status and status not in STATUS_BY_CODE:
        raise FrameError(f"reply {seq}: unknown status {status}")
    header = ReplyHeader(seq, status, _dtype(dtype_code), compute_s, rows, cols, error_bytes)
    if min(rows, cols) < 0 or header.payload_bytes > MAX_PAYLOAD_BYTES:
        raise FrameError(f"reply {seq} announces {rows} x {cols} outputs, {error_bytes} error bytes")
    return header


def decode_reply(header: ReplyHeader, payload: bytearray) -> ExpertReply:
    if header.rows * header.cols == 0:
        return ExpertReply(torch.empty(header.rows, header.cols, dtype=header.dtype), header.compute_s)
    y = torch.frombuffer(payload, dtype=header.dtype, count=header.rows * header.cols).view(header.rows, header.cols)
    return ExpertReply(y, header.compute_s, owned=True)  # over this reply's own payload


def status_name(header: ReplyHeader) -> str:
    return STATUS_BY_CODE[header.status].name


# A data connection's first bytes: which session (opened by the OpenDataPlane RPC) it serves.
HELLO = struct.Struct("<4sH")  # magic, session byte count; the session follows
HELLO_MAGIC = b"MMh1"
MAX_SESSION_BYTES = 256


def encode_hello(session: str) -> list:
    data = session.encode()
    return [HELLO.pack(HELLO_MAGIC, len(data)), data]
