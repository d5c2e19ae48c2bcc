"""A server under test: where it is, which model it serves, how to force an output length.

`ignore_eos` (vLLM, pagedserve, llama.cpp) and `generation_config` (transformers serve,
which rejects unknown fields with 422) both make the server generate exactly
`max_tokens` tokens; `prepare` finds out which one a server takes with a 1-token request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import aiohttp

LENGTH_CONTROLS = ("auto", "ignore_eos", "generation_config", "none")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    model: str | None = None
    endpoint: str = "completions"
    length_control: str = "auto"

    @property
    def api_url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.url.rstrip("/") + path


def parse_target(spec: str) -> Target:
    """`NAME=URL`, or a bare URL named after its port."""
    name, sep, url = spec.partition("=")
    if not sep:
        url, name = spec, spec.rstrip("/").rsplit(":", 1)[-1]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"target {spec!r}: expected NAME=http://HOST:PORT")
    return Target(name=name, url=url.rstrip("/"))


def length_fields(control: str, output_len: int) -> dict:
    if control == "ignore_eos":
        return {"ignore_eos": True}
    if control == "generation_config":
        config = {"max_new_tokens": output_len, "min_new_tokens": output_len, "do_sample": False}
        return {"generation_config": json.dumps(config)}
    return {}


async def prepare(target: Target, session: aiohttp.ClientSession) -> Target:
    """Fill in the served model name and the length control the server accepts."""
    if target.model is None:
        async with session.get(target.url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            data = (await resp.json(content_type=None)).get("data") or []
        if not data:
            raise RuntimeError(f"{target.name}: /v1/models lists no model")
        target = replace(target, model=data[0]["id"])
    if target.length_control != "auto":
        return target
    errors = []
    for control in ("ignore_eos", "generation_config"):
        body = {"model": target.model, "max_tokens": 1, "temperature": 0.0, **length_fields(control, 1)}
        body.update({"messages": [{"role": "user", "content": "Hi"}]} if target.endpoint == "chat"
                    else {"prompt": "Hi"})
        async with session.post(target.api_url, json=body) as resp:
            text = await resp.text()
            if resp.status == 200:
                return replace(target, length_control=control)
            errors.append(f"{control}: HTTP {resp.status} {text[:200]}")
    raise RuntimeError(f"{target.name}: no way to force the output length works: {'; '.join(errors)}")
