"""Issue 11 against a real server on the tiny Llama, through the official `openai` client
(sync, async, streaming): the fields real clients send, answered as OpenAI answers them."""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def max_model_len(tiny_model_dir) -> int:
    import json

    return json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]


def test_unknown_model_is_404_with_an_openai_body(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]


def test_refused_field_is_named(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"typical_p": 0.5})
    assert info.value.body["param"] == "typical_p"


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, max_model_len, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    words = max_model_len - 40  # a long prompt, so that the rest is short to generate
    content = " ".join(["word"] * words)
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    used = len(tok.encode(text, add_special_tokens=False))
    assert used < max_model_len
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == used
    assert out.usage.prompt_tokens + out.usage.completion_tokens == max_model_len


def test_empty_stream_options_give_usage(tiny_server):
    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                                stream=True, stream_options={}, extra_body={"ignore_eos": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


# --- sampling fields: the served greedy output equals transformers with the same processors ----------


def _hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return _hf_model(tiny_model_dir)


def _hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


PROMPT = [17, 4021, 305, 911, 17, 17, 4021, 88, 3000, 12, 12, 12]


def _served(client, **fields) -> list[int]:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=fields.pop("max_tokens", 16),
                                    temperature=0, extra_body={"return_token_ids": True, **fields})
    return out.choices[0].model_extra["token_ids"]


def test_repetition_penalty_equals_transformers(client, hf_model):
    hf_model.generation_config.eos_token_id = None
    for penalty in (1.5, 0.8):
        want = _hf_generate(hf_model, PROMPT, 16, repetition_penalty=penalty)
        assert _served(client, repetition_penalty=penalty, ignore_eos=True) == want


def test_logit_bias_equals_sequence_bias(client, hf_model):
    hf_model.generation_config.eos_token_id = None
    plain = _served(client, ignore_eos=True, max_tokens=6)
    bias = {plain[0]: -100.0, 31: 8.0}
    want = _hf_generate(hf_model, PROMPT, 6, sequence_bias={(t,): b for t, b in bias.items()})
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logit_bias={str(t): b for t, b in bias.items()},
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == want != plain


def test_presence_and_frequency_penalties_follow_openai_formula(client, hf_model):
    import torch

    presence, frequency = 0.7, 1.1
    tokens = list(PROMPT)
    with torch.inference_mode():
        for _ in range(10):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(tokens[len(PROMPT):], dtype=torch.long),
                                    minlength=logits.shape[0]).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            tokens.append(int(logits.argmax()))
    got = _served(client, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True, max_tokens=10)
    assert got == tokens[len(PROMPT):]


def test_min_tokens_holds_back_eos(client, hf_model):
    # make EOS (id 2) the greedy choice from the start, then require 5 tokens before it
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    logit_bias={"2": 100}, extra_body={"return_token_ids": True, "min_tokens": 5})
    ids = out.choices[0].model_extra["token_ids"]
    assert len(ids) == 6 and ids[-1] == 2 and 2 not in ids[:5] and out.choices[0].finish_reason == "stop"


def test_min_p_and_allowed_token_ids_restrict_sampling(client):
    allowed = [100, 200, 300]
    for seed in range(3):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=seed, temperature=1.5,
                                        extra_body={"return_token_ids": True, "allowed_token_ids": allowed,
                                                    "min_p": 0.01, "ignore_eos": True})
        assert set(out.choices[0].model_extra["token_ids"]) <= set(allowed)


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("presence_penalty", 3), ("repetition_penalty", 0),
                                          ("logit_bias", {"x": 1}), ("logit_bias", {"999999": 1}),
                                          ("allowed_token_ids", []), ("min_tokens", 99)])
def test_bad_sampling_fields_are_400(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={field: value})
    assert info.value.body["param"] == field


# --- logprobs: log-softmax of transformers' float32 logits at the same positions -------------------


def _hf_logprobs(model, tokens: list[int]):
    """[len(tokens), vocab] log-softmax of the logits at each position (predicting the next token)."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def _check_token(lp, got_logprob, token_id):
    assert abs(got_logprob - float(lp[token_id])) < 1e-3


def test_completion_logprobs_whole_and_streamed(client, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    body = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**body)
    choice = whole.choices[0]
    ids = choice.model_extra["token_ids"]
    ref = _hf_logprobs(hf_model, PROMPT + ids)
    lps = choice.logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == len(lps.text_offset) == 5
    offset = 0
    for i, tok in enumerate(ids):
        row = ref[len(PROMPT) - 1 + i]
        _check_token(row, lps.token_logprobs[i], tok)
        assert int(row.argmax()) == tok  # greedy: the best candidate
        top3 = row.topk(3).indices.tolist()
        assert len(lps.top_logprobs[i]) == 3 and lps.tokens[i] in lps.top_logprobs[i]
        assert sorted(lps.top_logprobs[i].values(), reverse=True) == pytest.approx(
            [float(row[t]) for t in top3], abs=1e-3)
        assert lps.text_offset[i] == offset
        offset += len(lps.tokens[i])
    assert "".join(lps.tokens) == AutoTokenizer.from_pretrained(tiny_model_dir).decode(ids)  # specials shown too

    stream = client.completions.create(**body, stream=True)
    tokens, values, offsets = [], [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert tokens == lps.tokens and offsets == lps.text_offset
    assert values == pytest.approx(lps.token_logprobs, abs=1e-6)


def test_chat_logprobs_whole_streamed_and_async(client, hf_model, tiny_server, tiny_model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Name a colour."}]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    body = dict(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**body)
    ids = whole.choices[0].model_extra["token_ids"]
    ref = _hf_logprobs(hf_model, prompt + ids)
    content = whole.choices[0].logprobs.content
    assert len(content) == 4
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        _check_token(row, entry.logprob, ids[i])
        assert bytes(entry.bytes).decode("utf-8", "replace") == tok.decode([ids[i]]) or entry.token.startswith("bytes:")
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=1e-3)
    streamed = [e for chunk in client.chat.completions.create(**body, stream=True)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]

    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            return await c.chat.completions.create(**body)

    assert [e.logprob for e in asyncio.run(run()).choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in content], abs=1e-6)


def test_plain_responses_have_null_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert out.choices[0].logprobs is None
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"


# --- prompt scoring: echo + logprobs + max_tokens 0, and vLLM's prompt_logprobs ---------------------------


def test_echo_scores_the_prompt_like_transformers(client, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog because it wants to see what is on the other side."
    prompt = tok.encode(text)
    ref = _hf_logprobs(hf_model, prompt)
    want = [float(ref[i - 1, t]) for i, t in enumerate(prompt) if i > 0]
    for stream in (False, True):
        for _ in range(2):  # the second run finds the prompt's blocks in the prefix cache: scored all the same
            out = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1,
                                            temperature=0, stream=stream)
            chunks = list(out) if stream else [out]
            choices = [c for chunk in chunks for c in chunk.choices]
            assert "".join(c.text for c in choices) == text
            lps = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
            assert lps[0] is None and lps[1:] == pytest.approx(want, abs=1e-3)
            if not stream:
                assert out.usage.completion_tokens == 0 and choices[0].finish_reason == "length"
                assert len(choices[0].logprobs.tokens) == len(prompt)
                assert out.usage.prompt_tokens_details.cached_tokens == 0  # scored, so computed
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt's blocks are cached


def test_echo_with_generation_and_vllm_prompt_logprobs(client, hf_model):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert choice.text.endswith(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}).choices[0].text)
    ref = _hf_logprobs(hf_model, PROMPT)
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    plp = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for i in range(1, len(PROMPT)):
        entry = plp[i][str(PROMPT[i])]
        assert abs(entry["logprob"] - float(ref[i - 1, PROMPT[i]])) < 1e-3
        assert entry["rank"] == int((ref[i - 1] > ref[i - 1, PROMPT[i]]).sum()) + 1
        assert len(plp[i]) in (2, 3)  # the token itself and the top 2


# --- a batch of prompts ------------------------------------------------------------------------------


def test_batch_prompts_with_n_2_index_choices_prompt_times_n_plus_sample(client, tiny_server):
    prompts = ["The sky is", [17, 4021, 305], "Once upon a time"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True}) for p in prompts]
    body = dict(model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    assert [c.index for c in whole.choices] == list(range(6))
    for c in whole.choices:
        assert c.text == singles[c.index // 2].choices[0].text  # greedy: both samples alike
    assert whole.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert whole.usage.completion_tokens == 6 * 4

    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == set(range(6)) and texts == {c.index: c.text for c in whole.choices}

    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            return await c.completions.create(**body)

    assert [c.text for c in asyncio.run(run()).choices] == [c.text for c in whole.choices]


def test_a_bad_prompt_in_a_batch_fails_the_batch(client, tiny_server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=["fine", [1, 10**6]], max_tokens=2)
    tiny_server.wait_blocks_free()


# --- endpoints, chat options, detokenizer options, stop_reason ---------------------------------------


def _post(url: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tokenize_detokenize_version_and_models(tiny_server, tiny_model_dir, max_model_len, client):
    from transformers import AutoTokenizer

    from tests.helpers import get

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    status, out = _post(tiny_server.url + "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                                         "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok.encode("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == max_model_len and out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = _post(tiny_server.url + "/tokenize", {"messages": messages, "add_generation_prompt": True})
    want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)
    assert status == 200 and chat["tokens"] == want
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert served.usage.prompt_tokens == len(want)  # the same ids a chat request runs
    status, back = _post(tiny_server.url + "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": "Hello world"}
    assert _post(tiny_server.url + "/detokenize", {"tokens": [10**7]})[0] == 400
    assert _post(tiny_server.url + "/tokenize", {"model": "nope", "prompt": "x"})[0] == 404
    status, body = get(tiny_server.url + "/version")
    assert status == 200 and "version" in body
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == max_model_len


def test_chat_template_options(tiny_server, tiny_model_dir, client):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    for fields, kwargs in (({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                           ({"add_generation_prompt": False, "continue_final_message": True},
                            {"continue_final_message": True})):
        want = tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)
        status, out = _post(tiny_server.url + "/tokenize", {"messages": messages, **fields})
        assert status == 200 and out["tokens"] == want
        served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=fields)
        assert served.usage.prompt_tokens == len(want)
    status, out = _post(tiny_server.url + "/tokenize", {"messages": messages, "chat_template_kwargs": {"x": 1}})
    assert status == 200
    for bad in ({"continue_final_message": True}, {"chat_template_kwargs": {"tokenize": True}},
                {"chat_template_kwargs": [1]}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=bad)
        assert info.value.body["param"] in bad


def test_skip_special_tokens_and_stop_reason(client, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    special = tok.convert_tokens_to_ids("<|im_end|>")
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    extra = {"ignore_eos": True, "logit_bias": {str(special): 100}, "return_token_ids": True}
    shown = client.completions.create(**body, extra_body={**extra, "skip_special_tokens": False}).choices[0]
    hidden = client.completions.create(**body, extra_body=extra).choices[0]
    assert shown.model_extra["token_ids"] == [special] * 3
    assert shown.text == "<|im_end|>" * 3 and hidden.text == ""
    by_id = client.completions.create(**body, extra_body={**extra, "stop_token_ids": [special]}).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == special
    for prompt in ("The sky is", "Once upon a time", "1, 2, 3,", PROMPT):  # one whose output shows text
        body = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        plain = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0]
        if len(plain.text) >= 3:
            break
    assert plain.finish_reason == "length" and plain.model_extra["stop_reason"] is None
    stop = plain.text[1:3]
    by_str = client.completions.create(**body, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert by_str.finish_reason == "stop" and by_str.model_extra["stop_reason"] == stop


def test_bad_words_are_never_generated(client, hf_model, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf_model.generation_config.eos_token_id = None
    plain = _served(client, ignore_eos=True, max_tokens=8)
    word = tok.decode(plain[:1]).strip()
    if not word:  # a token that is only a space or a special token: pick the next one that shows
        word = next(tok.decode([t]).strip() for t in plain if tok.decode([t]).strip())
    banned = [ids for ids in (tok.encode(w, add_special_tokens=False) for w in (word, " " + word)) if ids]
    want = _hf_generate(hf_model, PROMPT, 8, bad_words_ids=banned)
    got = _served(client, ignore_eos=True, max_tokens=8, bad_words=[word])
    assert got == want != plain


def test_echo_with_n_2_and_a_batch_echoes_every_choice(client):
    out = client.completions.create(model=MODEL, prompt=["Hello there", [17, 4021]], n=2, max_tokens=2, echo=True,
                                    logprobs=0, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        lps = c.logprobs
        assert lps.token_logprobs[0] is None and len(lps.tokens) == 2 + 2  # both prompts are 2 tokens
        assert c.text.startswith("Hello there" if c.index < 2 else "".join(lps.tokens[:2]))
