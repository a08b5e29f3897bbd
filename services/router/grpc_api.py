"""The client-facing gRPC Generate API (moemesh.v1.Generate): translation to the frontend only."""

from __future__ import annotations

import contextlib
import uuid

import grpc

from moemesh.contracts.finish_reason import finish_reason_to_proto
from moemesh.contracts.sampling_proto import sampling_from_proto
from moemesh.proto.v1 import generate_pb2, generate_pb2_grpc
from moemesh.router.api_keys import ApiKeys
from moemesh.router.dispatcher import GenerateInput, InvalidRequest, RouterError, invalid_request
from moemesh.router.frontend import Frontend


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, frontend: Frontend, api_keys: ApiKeys = ApiKeys()):
        self.frontend = frontend
        self.api_keys = api_keys

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self.api_keys.allows(dict(context.invocation_metadata() or ()).get("authorization")):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid or missing API key (send metadata 'authorization: Bearer <key>')",
            )
        try:
            inputs = [(0, await self._input(request))]
            first = True
            async with contextlib.aclosing(self.frontend.run(inputs)) as deltas:
                async for d in deltas:
                    delta = d.delta
                    response = generate_pb2.GenerateResponse(
                        token_ids=delta.token_ids,
                        text=delta.text,
                        logprobs=delta.logprobs,
                        worker_id=delta.worker_id if first else "",
                    )
                    first = False
                    if delta.finish_reason is not None:
                        response.finish_reason = finish_reason_to_proto(delta.finish_reason)
                        response.usage.CopyFrom(
                            generate_pb2.Usage(
                                prompt_tokens=delta.num_prompt_tokens,
                                completion_tokens=delta.num_output_tokens,
                                cached_tokens=delta.num_cached_tokens,
                            )
                        )
                    yield response
        except RouterError as e:
            if e.param:
                context.set_trailing_metadata((("moemesh-param", e.param),))
            await context.abort(e.code, str(e))

    async def _input(self, request: generate_pb2.GenerateRequest) -> GenerateInput:
        frontend = self.frontend
        if request.model:
            frontend.check_model(request.model)
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt is required (text or token_ids)", param="prompt")
        prompt = await frontend.tokenize(request.text if kind == "text" else list(request.token_ids.ids))
        with invalid_request():  # the workers' own conversion and checks
            params = sampling_from_proto(request.sampling, tuple(request.stop))
        frontend.check_request(prompt, params)
        return GenerateInput(request.request_id or uuid.uuid4().hex, prompt, params)
