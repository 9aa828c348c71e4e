"""The FastAPI app: OpenAI-compatible `/v1/completions` and `/v1/chat/completions` (streaming too),
`/v1/models`, `/health`, and a bearer-token `/update_weights` through which a trainer in another process
pushes new policy weights between engine steps. One `AsyncEngine` serves every request."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from collections.abc import AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout.async_engine import AsyncEngine
from rollout.engine import Engine
from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams
from rollout.serve.protocol import ChatCompletionRequest, CompletionRequest
from rollout.serve.responses import Formatter, chat_choice, completion_choice, envelope, new_id, usage


class ApiError(Exception):
    """An error answered as vLLM's `{"error": {...}}` body with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def build_app(engine: Engine, *, model_name: str, weights_token: str | None = None) -> FastAPI:
    """The server over `engine`; `/update_weights` answers only `Authorization: Bearer <weights_token>`
    (disabled when None)."""
    server = _Server(engine, model_name, weights_token)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.async_engine = AsyncEngine(engine)  # bound to the server's event loop
        yield
        await server.async_engine.close()

    app = FastAPI(title="jax-rollout", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in err.errors())
        return _error(400, f"invalid request: {problems}")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error(err.status, err.message, err.kind)

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, err: ValueError) -> JSONResponse:
        return _error(400, str(err))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "jax-rollout",
                                            "max_model_len": engine.config.max_model_len,
                                            "policy_version": engine.policy_version}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> dict | StreamingResponse:
        server.check_model(body.model)
        prompts = [server.checked(p, lambda n: body.sampling_params(n)) for p in body.prompts()]
        return await server.respond(body, prompts, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest) -> dict | StreamingResponse:
        server.check_model(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                   tokenize=True)
        return await server.respond(body, [server.checked(ids, lambda n: body.sampling_params(n))], chat=True)

    @app.post("/update_weights")
    async def update_weights(request: Request, version: int | None = None, mapping: str = "hf",
                             recompute_running: bool = False) -> dict:
        server.authorize(request.headers.get("authorization"))
        tensors = await server.read_weights(request)
        await server.async_engine.sync_weights(tensors, mapping, version=version,
                                               recompute_running=recompute_running)
        return {"policy_version": engine.policy_version}

    return app


class _Server:
    """What the routes share: the engine, its async front, the served name and the weights token."""

    def __init__(self, engine: Engine, model_name: str, weights_token: str | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.weights_token = weights_token
        self.async_engine: AsyncEngine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(400, f"The model `{model}` does not exist; this server serves `{self.model_name}` "
                                "(GET /v1/models)", "NotFoundError")

    def checked(self, prompt: str | list[int], params_for: object) -> tuple[list[int], SamplingParams]:
        """Token ids and params of one prompt, validated by the engine (a ValueError is a 400)."""
        limit = self.engine.config.max_model_len
        probe = SamplingParams()
        ids = self.engine.check_request(prompt, probe)
        params = params_for(limit - len(ids))
        self.engine.check_request(ids, params)
        return ids, params

    async def respond(self, body: CompletionRequest | ChatCompletionRequest,
                      prompts: list[tuple[list[int], SamplingParams]], *, chat: bool) -> dict | StreamingResponse:
        fmt = Formatter(self.engine.tokenizer, body.return_tokens_as_token_ids)
        num_top = (getattr(body, "top_logprobs", None) or 0) if chat else 0
        rid = new_id("chatcmpl" if chat else "cmpl")
        kind = "chat.completion" if chat else "text_completion"
        n = prompts[0][1].n
        if body.stream:
            return StreamingResponse(self._stream(body, prompts, fmt, num_top, rid, chat), media_type="text/event-stream")
        outs = await asyncio.gather(*(self.async_engine.generate(ids, sp) for ids, sp in prompts))
        choices = [chat_choice(i * n + c.index, out, c, fmt, num_top, return_token_ids=body.return_token_ids)
                   if chat else completion_choice(i * n + c.index, out, c, fmt, return_token_ids=body.return_token_ids)
                   for i, out in enumerate(outs) for c in out.outputs]
        return envelope(rid, kind, self.model_name, choices, usage(list(outs)))

    async def _stream(self, body: CompletionRequest | ChatCompletionRequest, prompts: list[tuple[list[int], SamplingParams]],
                      fmt: Formatter, num_top: int, rid: str, chat: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        n = prompts[0][1].n
        started: set[int] = set()
        offsets: dict[int, int] = {}
        num_generated = 0
        finals: list[RequestOutput] = []
        async for i, out in _merged([self.async_engine.generate_stream(ids, sp) for ids, sp in prompts]):
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                first = index not in started
                started.add(index)
                num_generated += len(c.token_ids)
                if chat:
                    choices.append(chat_choice(index, out, c, fmt, num_top, return_token_ids=body.return_token_ids,
                                               delta=True, first=first))
                else:
                    choices.append(completion_choice(index, out, c, fmt, text_offset=offsets.get(index, 0),
                                                     return_token_ids=body.return_token_ids, first=first))
                    offsets[index] = offsets.get(index, 0) + len(c.text)
            if out.finished:
                finals.append(out)
            yield f"data: {json.dumps(envelope(rid, kind, self.model_name, choices, None))}\n\n"
        if body.include_usage:
            yield f"data: {json.dumps(envelope(rid, kind, self.model_name, [], usage(finals, num_generated)))}\n\n"
        yield "data: [DONE]\n\n"

    def authorize(self, header: str | None) -> None:
        if self.weights_token is None:
            raise ApiError(403, "weight updates are disabled: start the server with --weights-token "
                                "(or ROLLOUT_WEIGHTS_TOKEN)", "PermissionDeniedError")
        if header is None or not hmac.compare_digest(header.encode(), f"Bearer {self.weights_token}".encode()):
            raise ApiError(401, "missing or wrong bearer token for /update_weights", "AuthenticationError")

    async def read_weights(self, request: Request) -> dict[str, np.ndarray]:
        """The new weights: a safetensors body, or JSON `{"path": file or directory of .safetensors}`."""
        from safetensors.numpy import load, load_file

        body = await request.body()
        try:
            if request.headers.get("content-type", "").startswith("application/json"):
                path = json.loads(body)["path"]
                files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")) \
                    if os.path.isdir(path) else [path]
                return {k: v for f in files for k, v in load_file(f).items()}
            return load(body)
        except (KeyError, TypeError, OSError, ValueError, json.JSONDecodeError) as err:
            raise ApiError(400, f"could not read the weights ({type(err).__name__}: {err}); send a safetensors "
                                "body (application/octet-stream) or JSON {\"path\": ...}") from err


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as err:  # the caller sees it
            await queue.put((i, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, out = await queue.get()
            if out is None:
                left -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
