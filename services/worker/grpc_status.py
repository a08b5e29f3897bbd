"""What both worker servicers do with a call before and around the engine: refuse while the model
loads, parse the sampling parameters (with the checks the router applied: contracts/sampling.py),
and map the engine's errors onto gRPC status codes.

    InvalidRequestError   -> INVALID_ARGUMENT (the bad field in trailing metadata `moemesh-param`)
    EngineDeadError       -> UNAVAILABLE (the router retries elsewhere)
    ExpertUnavailableError -> ABORTED (another worker would fail the same way)
"""

from __future__ import annotations

import contextlib

import grpc

from moemesh.contracts.sampling import SamplingParams
from moemesh.contracts.sampling_proto import sampling_from_proto
from moemesh.engine.async_engine import AsyncEngine, EngineDeadError
from moemesh.engine.errors import ExpertUnavailableError, InvalidRequestError
from moemesh.proto.v1 import common_pb2


async def abort_invalid(context: grpc.aio.ServicerContext, error: InvalidRequestError) -> None:
    if error.param:
        context.set_trailing_metadata((("moemesh-param", error.param),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


async def admit(engine: AsyncEngine, sampling: common_pb2.SamplingParams, context) -> SamplingParams:
    """The call's SamplingParams, or abort: UNAVAILABLE while loading, INVALID_ARGUMENT if bad."""
    if not engine.is_ready:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
    try:
        return sampling_from_proto(sampling)
    except InvalidRequestError as e:
        await abort_invalid(context, e)


@contextlib.asynccontextmanager
async def engine_errors_as_status(context: grpc.aio.ServicerContext):
    """Aborts the call with the status of an engine error raised inside the block."""
    try:
        yield
    except InvalidRequestError as e:
        await abort_invalid(context, e)
    except EngineDeadError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    except ExpertUnavailableError as e:  # not UNAVAILABLE: retrying on another worker would not help
        await context.abort(grpc.StatusCode.ABORTED, str(e))
