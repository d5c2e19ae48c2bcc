"""LoRA adapters on the routes beside completions and chat, through a real server and the real
SDK clients: Anthropic's /v1/messages (the `anthropic` SDK), /v1/responses and /v1/embeddings
(the `openai` SDK) run `model: <adapter name>` under that adapter: the answer names it, its
greedy text differs from the base model's and equals the chat route's for the same
conversation, an embedding equals PEFT's merged model's, and an unknown adapter is a 404 in
each route's own error shape."""

from __future__ import annotations

import anthropic
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers import ServerProcess
from tests.lora_helpers import make_peft_adapter, merged_model

BASE = "tiny-llama"
ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]
MAX_TOKENS = 8
TEXT = "Paged attention keeps the KV cache in blocks."
GREEDY = {"extra_body": {"temperature": 0, "ignore_eos": True}}  # the anthropic SDK has no sampling arguments


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "first", rank=8, seed=1, scale=3.0)


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--quantization", "none", "--served-model-name", BASE, "--max-loras", "2",
             "--max-lora-rank", "16", "--lora-modules", f"first={adapter_dir}"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("run"), extra) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def chat_text(oai: openai.OpenAI, model: str, ignore_eos: bool = True) -> tuple[str, int]:
    """The chat route's greedy answer to ASK and its token count."""
    out = oai.chat.completions.create(model=model, messages=ASK, max_completion_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": ignore_eos})
    assert out.model == model
    return out.choices[0].message.content, out.usage.completion_tokens


def test_messages_route_runs_the_adapter(claude, oai):
    texts = {}
    for model in ("first", BASE):
        msg = claude.messages.create(model=model, max_tokens=MAX_TOKENS, messages=ASK, **GREEDY)
        assert msg.model == model and msg.usage.output_tokens == MAX_TOKENS
        texts[model] = msg.content[0].text
        assert (texts[model], MAX_TOKENS) == chat_text(oai, model)
    assert texts["first"] != texts[BASE]
    with claude.messages.stream(model="first", max_tokens=MAX_TOKENS, messages=ASK, **GREEDY) as stream:
        assert stream.get_final_text() == texts["first"]
    assert claude.messages.count_tokens(model="first", messages=ASK).input_tokens == \
        claude.messages.count_tokens(model=BASE, messages=ASK).input_tokens


def test_messages_route_unknown_adapter_is_an_anthropic_404(claude):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-adapter", max_tokens=4, messages=ASK)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    assert "no-such-adapter" in err.value.body["error"]["message"]


def test_responses_route_runs_the_adapter(oai):
    texts = {}
    for model in ("first", BASE):  # /v1/responses refuses ignore_eos: the answers may stop early, alike
        resp = oai.responses.create(model=model, input=ASK[0]["content"], max_output_tokens=MAX_TOKENS,
                                    temperature=0, store=False)
        assert resp.model == model
        texts[model] = resp.output_text
        assert (texts[model], resp.usage.output_tokens) == chat_text(oai, model, ignore_eos=False)
    assert texts["first"] != texts[BASE]
    events = oai.responses.create(model="first", input=ASK[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0,
                                  store=False, stream=True)  # may end `incomplete` (max_output_tokens)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == texts["first"]


def test_responses_route_unknown_adapter_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model="no-such-adapter", input="Hi", max_output_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_embeddings_route_runs_the_adapter(oai, tiny_model_dir, adapter_dir):
    """The adapter's vector is the mean of PEFT's merged model's final normed hidden states."""
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(TEXT)["input_ids"]
    vectors = {}
    for model, adapter in (("first", adapter_dir), (BASE, None)):
        out = oai.embeddings.create(model=model, input=TEXT)
        assert out.model == model and out.usage.prompt_tokens == len(ids)
        vectors[model] = np.array(out.data[0].embedding, dtype=np.float32)
        with torch.no_grad():
            h = merged_model(tiny_model_dir, adapter)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        np.testing.assert_allclose(vectors[model], torch.nn.functional.normalize(h[0].mean(0), dim=0).numpy(),
                                   atol=1e-5)
    assert np.abs(vectors["first"] - vectors[BASE]).max() > 1e-2


def test_embeddings_route_unknown_adapter_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as err:
        oai.embeddings.create(model="no-such-adapter", input=TEXT)
    assert err.value.body["code"] == "model_not_found"
