"""The requests of issue 19 that made one request fail, stall or starve the others, shared by
`tests/e2e/test_hostile.py` and `python -m benchmarks.chaos`.

Each `Attack` is one HTTP request with the outcome it must get: `expect` holds the statuses
allowed (a 4xx naming the cause, or 200 where the engine must now simply serve it), and
`check` an optional test of the answer's body. Sizes are those of the findings (16 prompts x
n 16 with whole-vocabulary `allowed_token_ids`, 1,024 `logit_bias` entries and long
`bad_words`) scaled only where the gateway's default limits now refuse them, which is the
point: the ones under the limits must be served, the ones over them refused with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

VOCAB = 49152


@dataclass
class Attack:
    name: str
    path: str
    body: dict
    expect: frozenset[int]
    headers: dict[str, str] = field(default_factory=dict)
    check: Callable[[int, dict], str | None] | None = None  # an answer's problem, or None


def _error_names(word: str) -> Callable[[int, dict], str | None]:
    def check(status: int, data: dict) -> str | None:
        if status == 200:
            return None
        error = data.get("error") or {}
        text = f"{error.get('message', '')} {error.get('param') or ''}"
        return None if word in text else f"the error does not name {word!r}: {error}"
    return check


def _served(n: int) -> Callable[[int, dict], str | None]:
    def check(status: int, data: dict) -> str | None:
        if status != 200:
            return f"status {status}: {data.get('error')}"
        got = len(data.get("choices", []))
        return None if got == n else f"{got} choices, expected {n}"
    return check


def deep_schema(depth: int) -> dict:
    """A chain of nested objects, depth levels deep (its text grows linearly)."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}}
    return schema


def exploding_schema(depth: int) -> dict:
    """Nested oneOf whose compiled grammar multiplies with each level (16 MB at depth 6 on
    SmolLM2's vocabulary) while its text stays small: each level names the one below twice."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"oneOf": [{"type": "object", "properties": {f"a{i}": schema, "b": {"type": "integer"}},
                             "required": [f"a{i}"]}, {"type": "array", "items": schema}]}
    return schema


def slow_schema(properties: int = 150) -> dict:
    """A schema that xgrammar takes seconds to compile on SmolLM2's vocabulary (each property
    a pattern of its own)."""
    return {"type": "object", "required": [f"p{i}" for i in range(properties)],
            "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x{i}[0-9]+$"}
                           for i in range(properties)}}


def attacks() -> list[Attack]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    prompt = [7 + i for i in range(40)]
    four_hundred = frozenset({400})
    huge_sampling = {
        "prompt": [[11 + p + i for i in range(12)] for p in range(16)], "n": 16, "max_tokens": 2,
        "temperature": 1.0, "seed": 5,
        "allowed_token_ids": list(range(VOCAB)),
        "logit_bias": {str(t): 0.5 for t in range(1000, 2024)},
        "bad_words": [f" forbidden{i} word{i} phrase{i}" for i in range(60)],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    out = [
        # a grammar and the request's own masks leave no token: refused at admission
        Attack("json_object_one_allowed_id", "/v1/chat/completions",
               {**chat, "response_format": {"type": "json_object"}, "allowed_token_ids": [81]}, four_hundred,
               check=_error_names("allowed_token_ids")),
        Attack("choice_with_min_tokens", "/v1/completions",
               {"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["yes"]}, "min_tokens": 6},
               four_hundred, check=_error_names("min_tokens")),
        # ... or found only in the step where it runs out: that row fails, the step goes on
        Attack("grammar_banned_by_bad_words", "/v1/completions",
               {"prompt": "x", "max_tokens": 4, "n": 2, "structured_outputs": {"regex": "a"}, "bad_words": ["a"]},
               four_hundred, check=_error_names("bad_words")),
        # the finding's step-size attack, under the gateway's limits: served, in bounded steps
        Attack("huge_sampling_16x16", "/v1/completions", huge_sampling, frozenset({200}), check=_served(256)),
        # over the limits: a 400 naming the field
        Attack("allowed_ids_past_vocab", "/v1/completions",
               {**huge_sampling, "n": 1, "allowed_token_ids": list(range(VOCAB + 16))}, four_hundred,
               check=_error_names("allowed_token_ids")),
        Attack("logit_bias_over_limit", "/v1/completions",
               {"prompt": "x", "max_tokens": 2, "logit_bias": {str(t): 1 for t in range(1025)}}, four_hundred,
               check=_error_names("logit_bias")),
        Attack("echo_logprobs_n_long_prompts", "/v1/completions",
               {"prompt": [list(range(5, 505))] * 16, "n": 16, "echo": True, "logprobs": 20, "max_tokens": 1},
               four_hundred),
        Attack("schema_too_deep", "/v1/chat/completions",
               {**chat, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": deep_schema(80)}}},
               four_hundred, check=_error_names("response_format")),
        # under the depth limit, but its compiled grammar explodes: the grammar pool's size limit
        Attack("oneof_grammar_too_big", "/v1/chat/completions",
               {**chat, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": exploding_schema(6)}}},
               four_hundred, check=_error_names("grammar")),
        # seconds of compile in a worker process, never on a loop: served or refused by its time limit
        Attack("slow_schema", "/v1/chat/completions",
               {**chat, "max_tokens": 4, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": slow_schema()}}},
               frozenset({200, 400})),
        Attack("too_many_tools", "/v1/chat/completions", {**chat, "tools": [tool] * 129}, four_hundred,
               check=_error_names("tools")),
        Attack("too_many_bad_words", "/v1/completions",
               {"prompt": "x", "max_tokens": 2, "bad_words": [f"w{i}" for i in range(65)]}, four_hundred,
               check=_error_names("bad_words")),
        Attack("bad_cache_salt", "/v1/completions", {"prompt": "x", "max_tokens": 2, "cache_salt": ""},
               four_hundred, check=_error_names("cache_salt")),
        # DNS rebinding: a page on another name reaching a loopback server
        Attack("foreign_host", "/v1/completions", {"prompt": "x", "max_tokens": 2}, frozenset({403}),
               headers={"Host": "rebound.attacker.example"}),
    ]
    # tenants with their own salts: the same prompt never reuses the other's cached KV
    for salt in ("tenant-a", "tenant-b"):
        out.append(Attack(f"cache_salt_{salt}", "/v1/completions",
                          {"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt},
                          frozenset({200}), check=_served(1)))
    return out


async def send(session: aiohttp.ClientSession, url: str, attack: Attack) -> tuple[int, dict]:
    async with session.post(url + attack.path, data=json.dumps(attack.body).encode(),
                            headers={"Content-Type": "application/json", **attack.headers}) as resp:
        raw = await resp.read()
    try:
        data = json.loads(raw)
    except ValueError:
        data = {"raw": raw[:200].decode(errors="replace")}
    return resp.status, data if isinstance(data, dict) else {"raw": data}


def problem(attack: Attack, status: int, data: dict) -> str | None:
    """What is wrong with this answer to the attack, or None."""
    if status not in attack.expect:
        return f"{attack.name}: status {status} (expected {sorted(attack.expect)}): {str(data)[:300]}"
    if attack.check is not None:
        why = attack.check(status, data)
        if why:
            return f"{attack.name}: {why}"
    return None
