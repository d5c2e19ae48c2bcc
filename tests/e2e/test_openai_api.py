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
