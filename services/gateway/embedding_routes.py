"""POST /v1/embeddings: each input as a prefill-only request down the whole pipeline.

The body is parsed and bounded (`openai.embeddings`), admission decides as for a generation
(queue bound, every stage alive), then every input goes to a tokenizer replica and on to an
engine's scheduler like a generation (`EngineClient.open`), all at once: the scheduler batches
them with everything else, holds their KV blocks for the prefill (chunked like any prompt,
sharing the prefix cache) and answers each with a `PooledOutput` instead of tokens. The first
error of any input is the answer (the others are aborted); a prompt over the context is the
scheduler's 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import AsyncExitStack

from aiohttp import web

from services.gateway.engine_client import EngineClient, EngineError, RequestTimeout
from services.gateway.openai.embeddings import EmbeddingsRequest, embeddings_body, parse_embeddings, vector_of
from services.gateway.openai.errors import ApiError
from services.gateway.openai.request import parse_json
from shared.messages import PooledOutput


class EmbeddingRoutes:
    def __init__(self, gateway, pooling: str, hidden_size: int):
        """gateway: the `app.Gateway` (its client, admission, limits, body reader and errors)."""
        self.gateway, self.pooling, self.hidden_size = gateway, pooling, hidden_size

    async def embeddings(self, request: web.Request) -> web.Response:
        g = self.gateway
        if request.content_type != "application/json":
            return g.error(ApiError("The request body must be JSON, sent with 'Content-Type: application/json'.",
                                    415, code="unsupported_media_type"))
        try:
            body = parse_json(await g._read_body(request))
            parsed = parse_embeddings(body, g.loras.names(g.model_names), self.hidden_size, g.limits)
            parsed = dataclasses.replace(parsed, lora=g.loras.get(body.get("model")))
        except ApiError as exc:
            return g.error(exc)
        refused = g.admission.check_capacity()
        if refused is not None:
            g.metrics.rejected.labels(reason=refused.code or refused.error_type).inc()
            return g.error(refused)
        try:
            outputs = await self._run(g.client, parsed, g.timeout_s)
        except EngineError as exc:
            return g.error(g.engine_error(exc))
        except RequestTimeout:
            return g.error(g._timeout_error())
        vectors = [vector_of(o.embedding, parsed.dimensions) for o in outputs]
        body = embeddings_body(vectors, sum(o.num_prompt_tokens for o in outputs),
                               parsed.lora.name if parsed.lora else g.served_model_name, parsed.encoding_format)
        return web.json_response(body, dumps=g.dumps)

    async def _run(self, client: EngineClient, parsed: EmbeddingsRequest, timeout_s: float) -> list[PooledOutput]:
        request_id = f"embd-{uuid.uuid4().hex}"
        async with AsyncExitStack() as streams:
            opened = [await streams.enter_async_context(client.open(r, timeout_s))
                      for r in parsed.to_generates(request_id, self.pooling)]
            tasks = [asyncio.ensure_future(s.next()) for s in opened]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for t in tasks:  # the first error is the answer: the rest are cancelled (and aborted on exit)
                    t.cancel()
