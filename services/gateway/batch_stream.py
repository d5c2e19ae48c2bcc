"""A batch of prompts answered as one request: one engine request per prompt, merged.

`/v1/completions` with `prompt` as a list runs each prompt as its own request down the
pipeline (they share KV blocks through the prefix cache) and merges their TextDeltas
as they come, renumbering choices as OpenAI does: prompt i, sample j -> index i * n + j.
It behaves as a RequestStream: `async with` opens every request (and aborts those left
unfinished on exit), `next()` returns the next delta of any of them and raises the
first error any of them ends with (the others are then aborted).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from services.gateway.engine_client import EngineClient, RequestStream
from services.gateway.output_text import TextDelta
from shared.messages import GenerateRequest


class BatchStream:
    def __init__(self, client: EngineClient, requests: list[GenerateRequest], timeout_s: float, request_id: str):
        self.request_id = request_id
        self._streams = [client.open(r, timeout_s) for r in requests]
        self._n = requests[0].params.n
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._exits = contextlib.AsyncExitStack()

    async def __aenter__(self) -> BatchStream:
        try:
            for stream in self._streams:
                await self._exits.enter_async_context(stream)
        except BaseException:
            await self._exits.aclose()
            raise
        self._tasks = [asyncio.get_running_loop().create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._exits.aclose()

    async def _pump(self, prompt: int, stream: RequestStream) -> None:
        try:
            while not stream.done:
                delta = await stream.next()
                await self._queue.put(msgspec.structs.replace(delta, seq_index=prompt * self._n + delta.seq_index))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EngineError, RequestTimeout: the batch ends with it
            await self._queue.put(exc)

    async def next(self) -> TextDelta:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item
