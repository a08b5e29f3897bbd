"""OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions (SSE
streaming, always ended by `data: [DONE]`, also after an error event), /tokenize, /detokenize and
/version (as vLLM's), /live (liveness), /health (readiness: 503 until a decode worker is
routable), /metrics. Errors are OpenAI error objects with the status of the RouterError (400
invalid, 404 unknown model, 429 overloaded, 503 no worker; 429 and 503 carry Retry-After).
API keys, the body-size limit and the last-resort 500 live in `http_guard`.

A client that disconnects cancels its request: for streams Starlette cancels the response
iterator; for plain responses the handler watches for the disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from moemesh.router.dispatcher import GenerateInput, RouterError, Unavailable
from moemesh.router.frontend import ChoiceDelta, Frontend
from moemesh.router.http_guard import GuardSettings, HttpGuard
from moemesh.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LogprobFormatter,
    TokenizeRequest,
    error_body,
    new_id,
    now,
    openai_finish_reason,
    usage,
)
from moemesh.router.tool_calls import ToolRequest, merge_pieces
from moemesh.runtime.version import VERSION as __version__

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what 429 and 503 answers tell clients to wait


def build_app(frontend: Frontend, num_decode_workers, guard: GuardSettings = GuardSettings()) -> FastAPI:
    """`num_decode_workers()` -> how many decode workers the router can route to (for /health)."""
    app = FastAPI(title="moemesh router", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(HttpGuard, settings=guard)
    logprob_fmt = LogprobFormatter(frontend.tokenizer)

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, e: RouterError):
        code = "model_not_found" if e.status == 404 else None
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
        return JSONResponse(error_body(str(e), e.error_type, e.param, code), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "extra_forbidden":
            param = loc[0] if loc else None
            message = f"unknown field {'.'.join(loc)!r}"
        elif first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
        else:
            param = loc[0] if loc else None
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None, None), status_code=e.status_code)

    @app.get("/live")
    async def live():  # liveness: the process serves HTTP; readiness is /health
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health():
        count = num_decode_workers()
        status = 200 if count else 503
        return JSONResponse({"status": "ok" if count else "no decode worker", "decode_workers": count}, status)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            frontend.check_model(body.model)
        body.check()
        if body.messages is not None:
            token_ids = await frontend.tokenize_chat(body.conversation(), body.add_generation_prompt)
        else:
            assert body.prompt is not None  # body.check(): exactly one of the two
            token_ids = await frontend.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(token_ids), "max_model_len": frontend.max_model_len, "tokens": token_ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            frontend.check_model(body.model)
        return {"prompt": await frontend.detokenize(body.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(frontend.model_name)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        frontend.check_model(model)
        return _model_card(model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        frontend.check_model(body.model)
        body.check_unsupported()
        prompts = [await frontend.tokenize(p) for p in body.prompts()]
        inputs = _inputs(frontend, prompts, body, body.logprobs)
        meta = {"id": new_id("cmpl"), "created": now(), "model": frontend.model_name}

        def choice(index: int, text: str, logprobs, offset: int, finish) -> dict:
            lp = logprob_fmt.completion(logprobs, offset) if body.logprobs is not None else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": openai_finish_reason(finish)}

        if body.stream:
            return await _sse(
                request,
                frontend,
                inputs,
                body.include_usage,
                meta,
                "text_completion",
                lambda d, offset: [choice(d.index, d.delta.text, d.delta.logprobs, offset, d.delta.finish_reason)],
            )
        results = await _collect(request, frontend, inputs)
        choices = [choice(i, r["text"], r["logprobs"], 0, r["finish_reason"]) for i, r in enumerate(results)]
        return {**meta, "object": "text_completion", "choices": choices, "usage": _usage(results)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        frontend.check_model(body.model)
        body.check_unsupported()
        tools = ToolRequest(body.tools, body.tool_choice, body.parallel_tool_calls, frontend.tool_parser)
        prompt = await frontend.tokenize_chat(body.conversation(), tools=tools.prompt_tools())
        inputs = _inputs(frontend, [prompt], body, body.num_logprobs(), tools.constraint())
        meta = {"id": new_id("chatcmpl"), "created": now(), "model": frontend.model_name}

        if body.stream:
            started: set[int] = set()
            readers: dict[int, Any] = {}  # choice -> its tool-call stream reader
            called: set[int] = set()  # choices that streamed a tool call

            def chunk_choices(d: ChoiceDelta, offset: int) -> list[dict]:
                finish = openai_finish_reason(d.delta.finish_reason)
                if tools.active:
                    reader = readers.setdefault(d.index, tools.stream())
                    delta = merge_pieces(reader.feed(d.delta.text, finish is not None))
                    if "tool_calls" in delta:
                        called.add(d.index)
                    finish = tools.finish_reason(finish, d.index in called)
                else:
                    delta = {"content": d.delta.text} if d.delta.text or not finish else {}
                if d.index not in started:  # the first chunk of a choice names the role
                    started.add(d.index)
                    delta = {"role": "assistant", "content": delta.pop("content", ""), **delta}
                elif not (delta or finish or (body.logprobs and d.delta.logprobs)):
                    return []
                lp = logprob_fmt.chat(d.delta.logprobs) if body.logprobs else None
                return [{"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]

            return await _sse(
                request, frontend, inputs, body.include_usage, meta, "chat.completion.chunk", chunk_choices
            )
        results = await _collect(request, frontend, inputs)
        choices = []
        for i, r in enumerate(results):
            message, finish = {"role": "assistant", "content": r["text"]}, openai_finish_reason(r["finish_reason"])
            if tools.active:
                content, calls = tools.parse(r["text"])
                message["content"] = content
                if calls:
                    message["tool_calls"] = [c.to_openai() for c in calls]
                finish = tools.finish_reason(finish, bool(calls))
            lp = logprob_fmt.chat(r["logprobs"]) if body.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        return {**meta, "object": "chat.completion", "choices": choices, "usage": _usage(results)}

    return app


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "moemesh"}


def _inputs(frontend: Frontend, prompts: list[list[int]], body, logprobs: int | None, constraint=None) -> list:
    """One GenerateInput per choice, its parameters checked as the engine checks them.
    `constraint`: a tool choice's StructuredOutputSpec, exclusive with the body's own."""
    request_id = uuid.uuid4().hex
    inputs = []
    for p, prompt in enumerate(prompts):
        max_tokens = frontend.max_tokens(len(prompt), body.requested_max_tokens())
        for i in range(body.n):
            params = body.sampling_params(max_tokens, logprobs, i, constraint)
            if i == 0:  # the choices differ in their seed only
                frontend.check_request(prompt, params)
            inputs.append((p, GenerateInput(f"{request_id}-{p * body.n + i}", prompt, params)))
    return inputs


async def _collect(request: Request, frontend: Frontend, inputs) -> list[dict]:
    """Run every choice to the end; cancel them if the client goes away."""
    results = [{"text": "", "logprobs": [], "finish_reason": None, "prompt": p, "usage": (0, 0, 0)} for p, _ in inputs]

    async def consume() -> None:
        async for d in frontend.run(inputs):
            r = results[d.index]
            r["text"] += d.delta.text
            r["logprobs"].extend(d.delta.logprobs)
            r["usage"] = (d.delta.num_prompt_tokens, d.delta.num_output_tokens, d.delta.num_cached_tokens)
            if d.delta.finish_reason:
                r["finish_reason"] = d.delta.finish_reason

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise Unavailable("the client disconnected")
        task.result()
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return results


def _usage(results: list[dict]) -> dict:
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for r in results:
        num_prompt, num_output, num_cached = r["usage"]
        prompts[r["prompt"]] = (num_prompt, num_cached)
        completion += num_output
    return usage(sum(p for p, _ in prompts.values()), completion, sum(c for _, c in prompts.values()))


async def _sse(request, frontend: Frontend, inputs, include_usage: bool, meta: dict, obj: str, to_choices) -> Response:
    stream = frontend.run(inputs)
    try:  # errors before the first token (no worker, overloaded, invalid) get their HTTP status
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await stream.aclose()
        raise

    async def deltas() -> AsyncIterator[ChoiceDelta]:
        if first is not None:
            yield first
            async for d in stream:
                yield d

    async def events() -> AsyncIterator[str]:
        offsets = [0] * len(inputs)
        usage_of: dict[int, tuple[int, int, int]] = {}
        try:
            async for d in deltas():
                usage_of[d.index] = (d.delta.num_prompt_tokens, d.delta.num_output_tokens, d.delta.num_cached_tokens)
                choices = to_choices(d, offsets[d.index])
                offsets[d.index] += len(d.delta.text)
                if choices:
                    chunk = {**meta, "object": obj, "choices": choices}
                    if include_usage:
                        chunk["usage"] = None
                    yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                results = [{"prompt": p, "usage": usage_of.get(i, (0, 0, 0))} for i, (p, _) in enumerate(inputs)]
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': _usage(results)})}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the stream's last events say what went wrong
            if not isinstance(e, RouterError):
                logger.exception("stream %s failed", meta["id"])
                e = RouterError("internal error (logged by the router)")
            yield f"data: {json.dumps(error_body(str(e), e.error_type, e.param, None))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
