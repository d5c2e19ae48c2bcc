"""Issue 19 at the gateway, in process: every bound on a request's work is a flag that reaches
the gateway stage and a 400 naming its field; tool calls are found in one linear pass and a
deep one is text, not a 500; the Host check (over real HTTP); cache_salt is parsed and carried."""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import msgspec
import pytest
from aiohttp import web

from services.gateway.host_check import HostCheck, host_name
from services.gateway.limits import DEFAULT_LIMITS, RequestLimits, nesting_depth
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.errors import ApiError
from services.gateway.openai.field_policy import HARMLESS
from services.gateway.openai.responses import ResponseBuilder
from services.gateway.openai.tools import ToolMode, extract_calls, split_calls
from services.gateway.options import GatewayOptions
from shared.messages import SamplingParams
from shared.options import add_options, from_args

MODELS = {"m"}
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}


def refused(parse, body: dict, limits: RequestLimits = DEFAULT_LIMITS) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODELS, limits)
    assert info.value.status == 400
    return info.value


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# --- the limits: each a 400 naming its field -----------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
LIMITED = [  # (parser, body past a default limit, the param named)
    (parse_completion, {"prompt": "hi", "n": 17}, "n"),
    (parse_completion, {"prompt": ["a"] * 65}, "prompt"),
    (parse_completion, {"prompt": ["a"] * 64, "n": 5}, "n"),  # 320 sequences, past 256
    (parse_completion, {"prompt": ["a"] * 64, "n": 4, "use_beam_search": True, "beam_width": 5}, "beam_width"),
    (parse_completion, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (parse_chat, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    # echo over long prompts: 16 prompts x n 4 x 4,096 ids x (20 + 1) candidates
    (parse_completion, {"prompt": [[5] * 4096] * 16, "n": 4, "echo": True, "logprobs": 20}, "logprobs"),
    (parse_completion, {"prompt": ["x" * 60000] * 2, "prompt_logprobs": 10}, "prompt_logprobs"),
    (parse_chat, {"messages": [{"role": "user", "content": "x" * 200000}], "prompt_logprobs": 5},
     "prompt_logprobs"),
    (parse_completion, {"prompt": "hi", "stop": ["s"] * 17}, "stop"),
    (parse_completion, {"prompt": "hi", "stop": "s" * 257}, "stop"),
    (parse_completion, {"prompt": "hi", "stop_token_ids": [1] * 65}, "stop_token_ids"),
    (parse_completion, {"prompt": "hi", "bad_words": ["w"] * 65}, "bad_words"),
    (parse_completion, {"prompt": "hi", "bad_words": ["w" * 200] * 21}, "bad_words"),  # 4,200 characters
    (parse_completion, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    (parse_completion, {"prompt": "hi", "allowed_token_ids": list(range(65537))}, "allowed_token_ids"),
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": deep(70)}}},
     "response_format"),
    (parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"enum": ["x" * 1000] * 140}}}}, "response_format"),
    (parse_completion, {"prompt": "hi", "structured_outputs": {"json": deep(70)}}, "structured_outputs"),
    (parse_completion, {"prompt": "hi", "guided_json": json.dumps(deep(70))}, "guided_json"),
    (parse_completion, {"prompt": "hi", "guided_json": " " * 131073}, "guided_json"),
    (parse_completion, {"prompt": "hi", "json_schema": deep(70)}, "json_schema"),
    (parse_completion, {"prompt": "hi", "guided_regex": "a" * 65537}, "guided_regex"),
    (parse_completion, {"prompt": "hi", "structured_outputs": {"grammar": "a" * 65537}}, "structured_outputs"),
    (parse_completion, {"prompt": "hi", "guided_choice": ["c" * 1000] * 66}, "guided_choice"),
    (parse_chat, {**CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    (parse_chat, {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": deep(70)}}]},
     "tools"),
    (parse_chat, {**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {"p": {"enum": ["x" * 1000] * 10}}}}} for i in range(16)]},
     "tool_choice"),  # each tool's schema is small, all of them together past the schema bound
]


@pytest.mark.parametrize(("parse", "body", "param"), LIMITED, ids=[p for _, _, p in LIMITED])
def test_a_request_past_a_default_limit_is_a_400_naming_the_field(parse, body, param):
    err = refused(parse, body)
    assert err.param == param, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_what_honest_clients_send_is_within_the_defaults():
    """lm-eval's scoring batches, vLLM's n, OpenAI's bounds."""
    parse_completion({"prompt": [[5] * 2048] * 64, "echo": True, "logprobs": 1, "max_tokens": 0}, MODELS)
    parse_completion({"prompt": "hi", "n": 16, "logprobs": 20, "stop": ["a", "b", "c", "d"]}, MODELS)
    parse_chat({**CHAT, "logprobs": True, "top_logprobs": 20, "tools": [TOOL] * 1 + [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(127)]}, MODELS)
    parse_chat({**CHAT, "logit_bias": {str(i): -100 for i in range(300)}}, MODELS)
    parse_chat({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": deep(10)}}}, MODELS)


def test_the_limits_are_flags_that_travel_from_the_launcher_to_the_gateway_stage():
    from services import launcher
    from services.stage_options import add_stage_args
    from shared.config import Addresses

    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    args = parser.parse_args(["--model", "m", "--max-n", "2", "--max-schema-depth", "8", "--max-tools", "3",
                              "--allowed-hosts", "api.example,localhost"])
    cmd = launcher.stage_commands(args, Addresses.ipc("/tmp/x"))["gateway"]
    stage = argparse.ArgumentParser()
    add_stage_args(stage, "gateway")
    gateway_args = stage.parse_args(cmd[cmd.index("gateway") + 1:])
    limits = from_args(RequestLimits, gateway_args)
    assert (limits.max_n, limits.max_schema_depth, limits.max_tools) == (2, 8, 3)
    assert limits.max_logprobs == DEFAULT_LIMITS.max_logprobs
    assert gateway_args.allowed_hosts == "api.example,localhost"
    assert refused(parse_completion, {"prompt": "hi", "n": 3}, limits).param == "n"
    assert refused(parse_chat, {**CHAT, "tools": [TOOL] * 1 + [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]}, limits).param == "tools"
    with pytest.raises(SystemExit):  # a limit is at least 1
        stage.parse_args(["--model", "m", "--max-n", "0"])


def test_a_lower_limit_says_its_bound_in_the_message():
    limits = RequestLimits(max_logit_bias=4, max_grammar_chars=10)
    err = refused(parse_completion, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(5)}}, limits)
    assert "4" in err.message and err.param == "logit_bias"
    assert refused(parse_completion, {"prompt": "hi", "guided_regex": "a" * 11}, limits).param == "guided_regex"


def test_nesting_depth_is_counted_without_recursion_and_stops_early():
    assert nesting_depth("x", 5) == 0 and nesting_depth({}, 5) == 1 and nesting_depth([[1], {"a": [2]}], 5) == 3
    very = []
    for _ in range(200_000):  # far past Python's recursion limit
        very = [very]
    assert nesting_depth(very, 64) == 65


# --- cache_salt --------------------------------------------------------------------------


def test_cache_salt_is_parsed_into_the_sampling_params_on_both_endpoints():
    assert parse_completion({"prompt": "hi", "cache_salt": "tenant-a"}, MODELS).params.cache_salt == "tenant-a"
    assert parse_chat({**CHAT, "cache_salt": "tenant-b"}, MODELS).params.cache_salt == "tenant-b"
    assert parse_chat(CHAT, MODELS).params.cache_salt is None
    assert "cache_salt" not in HARMLESS
    for bad in ("", 7, ["a"], "s" * 257):
        assert refused(parse_completion, {"prompt": "hi", "cache_salt": bad}).param == "cache_salt"
    # it travels: the last field, and an array of the older fields still decodes
    params = SamplingParams(cache_salt="x")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams).cache_salt == "x"


# --- tool calls --------------------------------------------------------------------------

AUTO = ToolMode("auto", ("get",))


def test_tool_calls_are_found_as_before():
    text = 'Sure. <tool_call>\n {"name": "get", "arguments": {"q": 1}} \n</tool_call> done <tool_call>{"name": "nope"}' \
           '</tool_call>'
    content, calls = extract_calls(AUTO, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"q": 1})]
    assert content == "Sure.  done"
    assert extract_calls(AUTO, "no calls <tool_call> unclosed") == ("no calls <tool_call> unclosed", [])


def test_the_tool_call_scan_is_linear():
    """Inputs the old regex took cubic or quadratic time on; together they finish in tens of ms
    here (the old regex: 1.4 s for 1,000 spaces, so beyond the suite's 600 s timeout for these)."""
    spaces = "<tool_call>" + " " * 200_000 + "x"
    assert extract_calls(AUTO, spaces) == (spaces, [])
    opens = "<tool_call> " * 100_000
    assert split_calls(opens) == ([], opens)
    many = '<tool_call>{"name": "get"}</tool_call>' * 20_000
    blocks, rest = split_calls(many)
    assert len(blocks) == 20_000 and rest == ""


def test_a_deeply_nested_tool_call_is_text_not_an_error():
    for mode in (AUTO, ToolMode("required", ("get",))):
        text = ("<tool_call>" if mode is AUTO else "") + '{"a":' * 100_000 + "1" + "}" * 100_000
        assert extract_calls(mode, text) == (text, [])
    # a required answer of the wrong shape (cut short, or not calls) is text too
    assert extract_calls(ToolMode("required", ("get",)), "[1, 2]") == ("[1, 2]", [])


def test_a_long_answer_is_parsed_off_the_event_loop():
    out = ResponseBuilder("chat", "id", "m", tool_mode=AUTO)
    text = " " * 100_000 + '<tool_call>{"name": "get", "arguments": {}}</tool_call>'
    seen = []

    async def body():
        loop = asyncio.get_running_loop()
        real = loop.run_in_executor
        loop.run_in_executor = lambda *a: seen.append(a) or real(*a)
        await out.parse_calls(0, text)

    asyncio.run(body())
    assert len(seen) == 1
    choice = out.full([(text, "stop", [])], {})["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "get"


# --- the Host check ----------------------------------------------------------------------


def test_host_names_are_read_without_port_brackets_or_case():
    assert host_name("LocalHost:8000") == "localhost" and host_name("[::1]:80") == "::1"
    assert host_name("127.0.0.1") == "127.0.0.1" and host_name("example.com.") == "example.com"
    loopback = HostCheck(None, "127.0.0.1")
    assert all(loopback.allows(h) for h in ("localhost:1", "127.0.0.1:8000", "[::1]", "127.0.0.5", "a.localhost",
                                            None, ""))
    assert not any(loopback.allows(h) for h in ("evil.example", "localhost.evil.example", "10.0.0.1", "[::2]"))
    assert HostCheck(None, "0.0.0.0").names is None and HostCheck(None, "10.1.2.3").names is None
    assert HostCheck("*", "127.0.0.1").names is None
    named = HostCheck("api.example, Other.example:443", "127.0.0.1")
    assert named.allows("api.example:8000") and named.allows("other.example") and named.allows("127.0.0.1:9")
    assert not named.allows("localhost") and not named.allows("evil.example")


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def test_a_foreign_host_gets_a_403_over_real_http():
    async def body():
        app = web.Application(middlewares=[HostCheck(None, "127.0.0.1").middleware()])
        app.router.add_get("/health", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/health"
        try:
            async with aiohttp.ClientSession() as session:
                answers = {}
                for host in ("evil.example", f"localhost:{port}", f"127.0.0.1:{port}", "rebind.attacker:80"):
                    async with session.get(url, headers={"Host": host}) as resp:
                        answers[host] = (resp.status, await resp.json())
                return answers
        finally:
            await runner.cleanup()

    answers = asyncio.run(body())
    assert [status for status, _ in answers.values()] == [403, 200, 200, 403]
    error = answers["evil.example"][1]["error"]
    assert error["code"] == "host_not_allowed" and "evil.example" in error["message"]


def test_the_gateway_options_declare_allowed_hosts():
    parser = argparse.ArgumentParser()
    add_options(parser, [GatewayOptions])
    assert parser.parse_args([]).allowed_hosts is None


def test_the_openapi_description_states_the_limits_served():
    from services.gateway.openai.openapi import openapi_spec

    spec = openapi_spec(["m"], secured=False, lim=RequestLimits(max_n=3, max_tools=5, max_logprobs=7))
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = chat["properties"]
    assert props["n"]["maximum"] == 3 and props["tools"]["maxItems"] == 5 and props["top_logprobs"]["maximum"] == 7
    assert props["cache_salt"]["maxLength"] == 256


def test_compose_serves_the_names_its_clients_use():
    """The gateway binds 0.0.0.0 in its container (every host by default), but is published on the
    host's loopback: it names the hosts it answers to, those of the published port and Prometheus."""
    import yaml

    from tests.helpers import ROOT

    command = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["gateway"]["command"]
    default = command[command.index("--allowed-hosts") + 1].split(":-", 1)[1].rstrip("}")
    check = HostCheck(default, "0.0.0.0")
    assert all(check.allows(h) for h in ("localhost:8000", "127.0.0.1:8000", "gateway:8000"))
    assert not check.allows("rebound.attacker.example")
