"""The field policy of issue 11: no field that changes the answer is silently ignored."""

from __future__ import annotations

import json
import logging

import pytest

from services.gateway.openai import field_policy
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.errors import ApiError

NAMES = {"tiny"}


def completion(**body):
    return parse_completion({"model": "tiny", "prompt": "Hi", **body}, NAMES)


def chat(**body):
    return parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **body}, NAMES)


def refused(fn, **body) -> str:
    with pytest.raises(ApiError) as info:
        fn(**body)
    assert info.value.status == 400
    return info.value.param


def test_logprobs_zero_is_not_mistaken_for_false():
    # 0 == False in Python: a set-membership check let `logprobs: 0` through unseen
    assert field_policy.is_unused(False, ()) and not field_policy.is_unused(0, ())
    assert not field_policy.is_unused(1, (True,)) and not field_policy.is_unused(True, (1,))


def test_chat_default_max_tokens_is_the_rest_of_the_context():
    assert chat().params.max_tokens is None  # resolved by the tokenizer stage
    assert chat(max_tokens=7).params.max_tokens == 7
    assert completion().params.max_tokens == 16  # OpenAI's completions default stays


def test_llama_cpp_n_predict_is_max_tokens():
    assert completion(n_predict=5).params.max_tokens == 5
    assert completion(n_predict=-1).params.max_tokens is None
    assert completion(n_predict=5, max_tokens=3).params.max_tokens == 3
    assert refused(completion, n_predict=0) == "n_predict"


def test_empty_stream_options_mean_include_usage():
    assert completion(stream=True, stream_options={}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage
    assert not completion(stream=True).include_usage


@pytest.mark.parametrize("body", [
    {"suffix": "x"}, {"best_of": 3}, {"functions": [{"name": "f"}]},
    {"guided_whitespace_pattern": " "}, {"logits_processors": ["x"]}, {"typical_p": 0.5},
    {"chat_template": "{{ messages }}"}, {"mirostat": 2}, {"truncate_prompt_tokens": 3},
])
def test_answer_changing_fields_are_refused_by_name(body):
    (name,) = body
    assert refused(completion, **body) == name
    assert refused(chat, **body) == name


def test_neutral_values_and_harmless_fields_pass():
    base = completion().params
    assert completion(suffix="", best_of=1, response_format={"type": "text"}, tools=[], typical_p=1.0,
                      user="u", metadata={"a": "b"}, store=False, service_tier="auto").params == base
    assert chat(tool_choice="none", parallel_tool_calls=True).params == chat().params


def test_unknown_fields_are_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger=field_policy.__name__):
        completion(some_new_field_xyz=1)
        completion(some_new_field_xyz=2)
    hits = [r for r in caplog.records if "some_new_field_xyz" in r.getMessage()]
    assert len(hits) == 1


# --- logprobs fields (issue 11 step 3) and echo (step 4) -----------------------------------------


def test_logprobs_fields_become_sampling_params():
    assert completion(logprobs=0).params.logprobs == 0
    assert completion(logprobs=5).params.logprobs == 5 and completion().params.logprobs is None
    assert chat(logprobs=True).params.logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).params.logprobs == 4
    assert chat(logprobs=False).params.logprobs is None
    assert completion(prompt_logprobs=2).params.prompt_logprobs == 2


@pytest.mark.parametrize("fn, body, param", [
    (completion, {"logprobs": True}, "logprobs"), (completion, {"logprobs": 21}, "logprobs"),
    (completion, {"logprobs": -1}, "logprobs"), (chat, {"logprobs": 3}, "logprobs"),
    (chat, {"top_logprobs": 3}, "top_logprobs"), (chat, {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    (completion, {"logprobs": 1, "use_beam_search": True}, "logprobs"), (chat, {"echo": True}, "echo"),
    (completion, {"max_tokens": 0}, "max_tokens"),
])
def test_bad_logprobs_fields(fn, body, param):
    assert refused(fn, **body) == param


def test_echo_with_max_tokens_0_scores_the_prompt():
    req = completion(echo=True, max_tokens=0, logprobs=2)
    assert req.echo_only and req.params.max_tokens == 1 and req.params.echo
    assert req.params.prompt_logprobs == 2 and req.params.logprobs == 2
    assert completion(echo=True).params.prompt_logprobs is None  # echo alone needs no scoring


def test_a_batch_of_prompts_becomes_one_engine_request_each():
    req = completion(prompt=["a", [5, 6], "c"], n=2)
    assert req.num_prompts == 3
    gens = req.to_generates("cmpl-x")
    assert [g.request_id for g in gens] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    assert [(g.prompt, g.prompt_token_ids) for g in gens] == [("a", None), (None, [5, 6]), ("c", None)]
    assert completion(prompt=["solo"]).batch is None and completion(prompt=["solo"]).prompt == "solo"


def test_chat_and_detokenizer_options():
    req = chat(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"enable": True},
               skip_special_tokens=False, spaces_between_special_tokens=False, add_special_tokens=True)
    assert req.chat.add_generation_prompt is False and req.chat.continue_final_message
    assert req.chat.template_kwargs == {"enable": True} and req.add_special_tokens is True
    assert not req.params.skip_special_tokens and not req.params.spaces_between_special_tokens
    gen = req.to_generate("chatcmpl-1")
    assert gen.chat == req.chat and gen.add_special_tokens is True
    assert completion(add_special_tokens=False).to_generate("c").add_special_tokens is False
    assert refused(chat, continue_final_message=True) == "continue_final_message"
    assert refused(chat, chat_template_kwargs={"chat_template": "x"}) == "chat_template_kwargs"


def test_structured_output_fields_become_one_constraint():
    from shared.messages import StructuredOutput

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert chat(response_format=fmt).params.structured == StructuredOutput("json_schema", json.dumps(schema))
    assert chat(response_format={"type": "json_object"}).params.structured == StructuredOutput("json")
    assert chat(response_format={"type": "text"}).params.structured is None
    assert completion(structured_outputs={"choice": ["a", "b"]}).params.structured == StructuredOutput(
        "choice", '["a", "b"]')
    assert completion(guided_regex="x+").params.structured == StructuredOutput("regex", "x+")
    assert completion(structured_outputs={"json": json.dumps(schema)}).params.structured.kind == "json_schema"
    assert completion(json_schema=schema).params.structured.kind == "json_schema"  # llama.cpp's field
    assert refused(chat, response_format={"type": "json_object"}, guided_choice=["a"]) == "guided_choice"
    assert refused(chat, response_format={"type": "json_object"}, use_beam_search=True) == "use_beam_search"
    assert refused(chat, structured_outputs={"choice": []}) == "structured_outputs"


def test_auto_tool_calls_are_parsed_from_hermes_syntax():
    from services.gateway.openai.tools import ToolMode, extract_calls

    mode = ToolMode("auto", ("f", "g"))
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "x"}</tool_call>'
    content, calls = extract_calls(mode, text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert extract_calls(mode, "plain") == ("plain", [])
    assert extract_calls(ToolMode("none", ("f",)), text)[1] == []
    assert chat(tools=[{"type": "function", "function": {"name": "f"}}]).tool_mode.choice == "auto"
    assert refused(completion, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools"
