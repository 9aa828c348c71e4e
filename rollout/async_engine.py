"""`AsyncEngine`: an asyncio front of one `Engine` for agentic and asynchronous RL.

Many coroutines add requests and consume their outputs (`generate_stream`, `generate`); one background
task drives `Engine.step` while any request is unfinished. Engine calls are serialized by one lock and
the steps run in a worker thread, so the event loop (environments, tool calls, a trainer pushing
weights) keeps running while the device computes. `sync_weights` and `abort` take effect between steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from rollout.engine import Engine
from rollout.outputs import RequestOutput
from rollout.request_validation import Prompt
from rollout.sampling_params import SamplingParams


class AsyncEngine:
    """Concurrent callers over one engine; create it inside the running event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()  # one engine call at a time
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._work = asyncio.Event()  # set when a request arrives
        self._loop: asyncio.Task[None] | None = None

    async def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None,
                              request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps produce them (as its `output_kind` says; the last one has
        `finished=True`). Leaving the loop early (break, cancellation) aborts the request."""
        async for out in self._stream(lambda: self.engine.add_request(prompt, params, request_id)):
            yield out

    async def resume_stream(self, request_id: str, params: SamplingParams | None = None
                            ) -> AsyncIterator[RequestOutput]:
        """`Engine.resume` (an aborted or length-capped request goes on under the current weights), streamed."""
        async for out in self._stream(lambda: self.engine.resume(request_id, params)):
            yield out

    async def _stream(self, add: Callable[[], str]) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        async with self._lock:
            rid = add()  # a bad request raises here
            self._queues[rid] = queue
        self._start()
        done = False
        try:
            while not done:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                done = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not done:
                async with self._lock:
                    self.engine.abort(rid)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """The request's final output."""
        params = dataclasses.replace(params or SamplingParams(), output_kind="final_only")
        async for out in self.generate_stream(prompt, params, request_id):
            last = out
        return last

    async def abort(self, request_id: str) -> list[RequestOutput]:
        """End a request now (its stream ends with this output, `finish_reason="abort"`)."""
        async with self._lock:
            outs = self.engine.abort(request_id)
        for out in outs:
            self._deliver(out)
        return outs

    async def sync_weights(self, params: object, mapping: str | tuple | list | None = None,
                           **kwargs: object) -> None:
        """`Engine.sync_weights` between two steps; running requests go on under the new weights."""
        async with self._lock:
            await asyncio.to_thread(self.engine.sync_weights, params, mapping, **kwargs)
        self._work.set()  # a new version may admit held samples

    async def close(self) -> None:
        """Stop the background task (unfinished requests stay in the engine)."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None

    def _start(self) -> None:
        self._work.set()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()
            while True:
                async with self._lock:  # (held by lag-aware admission: wait for a sync or a new request)
                    if not self.engine.has_unfinished_requests() or self.engine.admission_held():
                        break
                    try:
                        outs = await asyncio.to_thread(self.engine.step)
                    except Exception as err:  # the step's requests were aborted: their callers get the error
                        for rid, queue in self._queues.items():
                            if rid not in self.engine.core.requests:
                                queue.put_nowait(err)
                        continue
                for out in outs:
                    self._deliver(out)
                await asyncio.sleep(0)  # let callers add, abort or sync between steps

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)
