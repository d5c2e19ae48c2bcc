"""Dynamo's `generate` endpoint: one async generator per request.

The PreprocessedRequest becomes a TokenizedRequest (`requests`), named after Dynamo's
context id, and goes to the scheduler; each TokenDelta comes back as an LLMEngineOutput
(`outputs`) until every choice has finished. When Dynamo stops or kills the context (the
client left, a stop string was found, the frontend is going away), or stops reading (the
generator is closed), the request is aborted at the scheduler, which frees its blocks.
A request the worker refuses, or that fails in the engine, ends with an "error: ..."
finish reason.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

from services.dynamo_worker.engine_link import EngineLink, EngineUnreachable
from services.dynamo_worker.outputs import ChoiceCounts, engine_output, error_output
from services.dynamo_worker.requests import UnsupportedRequest, tokenized_request
from shared.messages import RequestError, TokenDelta

log = logging.getLogger("pagedserve.dynamo_worker")

_STOPPED = object()  # queued when Dynamo stops the context
_numbers = itertools.count()


class GenerateHandler:
    def __init__(self, link: EngineLink, max_model_len: int, eos_token_ids: list[int]):
        self.link = link
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.requests_total = 0
        self.aborted_total = 0

    def _request_id(self, context: Any) -> str:
        context_id = None
        if context is not None:
            try:
                context_id = context.id()
            except Exception:  # an id is a convenience for logs: any unique name will do
                context_id = None
        return f"dyn-{context_id or next(_numbers)}-{next(_numbers)}"

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        request_id = self._request_id(context)
        try:
            msg = tokenized_request(request_id, request, self.max_model_len, self.eos_token_ids)
            queue = self.link.submit(msg)
        except (UnsupportedRequest, EngineUnreachable) as exc:
            yield error_output(str(exc))
            return
        self.requests_total += 1
        watch = _watch_context(context, queue)
        counts, unfinished, done = ChoiceCounts(), set(range(msg.params.n)), False
        try:
            while unfinished:
                item = await queue.get()
                if item is _STOPPED:
                    log.debug("%s: stopped by Dynamo", request_id)
                    return
                if isinstance(item, RequestError):
                    done = True
                    yield error_output(item)
                    return
                if isinstance(item, TokenDelta):
                    if item.finish_reason is not None:
                        unfinished.discard(item.seq_index)
                        done = not unfinished
                    yield engine_output(item, counts)
        finally:
            if watch is not None:
                watch.cancel()
            if done:
                self.link.release(request_id)
            else:
                self.aborted_total += 1
                self.link.abort(request_id)


def _watch_context(context: Any, queue: asyncio.Queue) -> asyncio.Future | None:
    """A future that queues _STOPPED once Dynamo stops or kills the request."""
    if context is None or not hasattr(context, "async_killed_or_stopped"):
        return None
    watch = asyncio.ensure_future(context.async_killed_or_stopped())

    def stopped(fut: asyncio.Future) -> None:
        if not fut.cancelled():
            queue.put_nowait(_STOPPED)

    watch.add_done_callback(stopped)
    return watch
