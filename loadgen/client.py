"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

The stream ends at `data: [DONE]`, at the end of the body, or at the chunk carrying
`finish_reason`: some servers (transformers serve) never send `[DONE]`. After that chunk
the client waits at most `grace` seconds for a separate usage chunk, outside the timing.
A status other than 200, a dropped connection, a timeout, an error event or a body that
ends before any finish all count as a failed request, with the reason kept.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import aiohttp

from loadgen.datasets import Request
from loadgen.metrics import RequestResult
from loadgen.targets import Target, length_fields
from loadgen.tokenizer import Tokenizer


def build_body(target: Target, req: Request, temperature: float, seed: int | None) -> dict:
    body = {
        "model": target.model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **length_fields(target.length_control, req.output_len),
    }
    if seed is not None:
        body["seed"] = seed
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send(session: aiohttp.ClientSession, target: Target, req: Request, index: int, run_start: float, *,
               temperature: float = 0.0, seed: int | None = None, timeout: float = 600.0, grace: float = 0.5,
               tokenizer: Tokenizer | None = None) -> RequestResult:
    result = RequestResult(index=index, ok=False, prompt_len=req.prompt_len, expected_output_len=req.output_len)
    body = build_body(target, req, temperature, seed)
    start = time.perf_counter()
    result.start = start - run_start
    token_times: list[float] = []
    texts: list[str] = []
    usage_tokens: int | None = None
    finished_at: float | None = None
    try:
        async with session.post(target.api_url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                result.status = resp.status
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            while True:
                if finished_at is None:
                    line = await resp.content.readline()
                else:
                    try:
                        line = await asyncio.wait_for(resp.content.readline(), max(0.0, finished_at + grace - time.perf_counter()))
                    except TimeoutError:
                        break
                if not line:
                    break
                now = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished_at = finished_at or now
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {str(event['error'])[:300]}"
                    return result
                choices = event.get("choices") or []
                text = "".join(_chunk_text(c) for c in choices)
                if text:
                    token_times.append(now)
                    texts.append(text)
                if finished_at is None and any(c.get("finish_reason") for c in choices):
                    finished_at = now
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    result.prompt_len = event["usage"].get("prompt_tokens") or result.prompt_len
                    if finished_at is not None:
                        break
    except TimeoutError:
        result.error = f"timeout: no complete answer within {timeout:g}s"
        return result
    except (aiohttp.ClientError, ConnectionError) as err:
        result.error = f"disconnected: {type(err).__name__}: {err}"[:300]
        return result
    except ValueError as err:  # bad JSON or UTF-8 in an event, or an overlong line
        result.error = f"bad event: {err}"[:300]
        return result
    if finished_at is None:
        result.error = "incomplete stream: body ended before any finish"
        return result
    result.ok = True
    result.e2e = finished_at - start
    result.ttft = (token_times[0] if token_times else finished_at) - start
    result.itl = [b - a for a, b in itertools.pairwise(token_times)]
    if usage_tokens is not None:
        result.output_tokens = usage_tokens
    elif tokenizer is not None:
        result.output_tokens = len(tokenizer.encode("".join(texts)))
    else:
        result.output_tokens = len(token_times)
    return result
