"""Concurrent greedy load for the recovery tests: whole and streamed requests, and what
each one ended with, in a form two runs can be compared by."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable

import aiohttp

from tests.helpers import sse_events


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.choice([3, 9, 17, 30]))] for _ in range(n)]


def greedy(prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}


async def whole(session: aiohttp.ClientSession, url: str, body: dict, headers=None) -> tuple:
    """(status, token ids, text) or (status, error type, message)."""
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        data = await resp.json()
    if resp.status != 200:
        return resp.status, data["error"]["type"], data["error"]["message"]
    choice = data["choices"][0]
    return 200, choice["token_ids"], choice["text"]


async def streamed(session: aiohttp.ClientSession, url: str, body: dict, headers=None,
                   on_chunk: Callable[[], None] = lambda: None) -> tuple:
    """(status, token ids, text, error event or None, ended with [DONE])."""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}, headers=headers) as resp:
        if resp.status != 200:
            data = await resp.json()
            return resp.status, [], "", data["error"], False
        raw = b""
        async for line in resp.content:
            raw += line
            if line.startswith(b"data: {"):
                on_chunk()
    text = raw.decode()
    ids, pieces, error = [], [], None
    for event in sse_events(text):
        if "error" in event:
            error = event["error"]
        for choice in event.get("choices", []):
            ids += choice.get("token_ids", [])
            pieces.append(choice["text"])
    return 200, ids, "".join(pieces), error, text.rstrip().endswith("data: [DONE]")


async def run_load(url: str, bodies: list[dict], stream_bodies: list[dict], headers=None,
                   on_chunk: Callable[[], None] = lambda: None) -> list[tuple]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        jobs = [whole(session, url, b, headers) for b in bodies]
        jobs += [streamed(session, url, b, headers, on_chunk) for b in stream_bodies]
        return await asyncio.gather(*jobs)


def dumps(results) -> str:
    return json.dumps(results)[:3000]
