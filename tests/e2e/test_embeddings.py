"""POST /v1/embeddings on the tiny Llama through the openai SDK: each input a prefill-only
request through the real pipeline, pooled (mean, the default for a causal LM) from the final
normed hidden states and checked against transformers' own; float and base64, dimensions,
token-id inputs, beside generations, errors, and every KV block freed after."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
import torch

MODEL = "tiny-llama"
TEXTS = ["The capital of France is", "Paged attention keeps the KV cache in blocks.", "hi"]


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def reference(hf, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    """transformers: the mean over the prompt's tokens of the final (normed) hidden state, unit length."""
    model, _ = hf
    with torch.no_grad():
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    v = h.mean(0)[:dimensions] if dimensions else h.mean(0)
    return torch.nn.functional.normalize(v, dim=0).numpy()


def test_string_matches_transformers_in_float_and_base64(client, hf, tiny_server):
    ids = hf[1](TEXTS[0])["input_ids"]
    as_float = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert as_float.object == "list" and as_float.model == MODEL and len(as_float.data) == 1
    assert as_float.data[0].index == 0 and as_float.data[0].object == "embedding"
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == len(ids)
    vec = np.array(as_float.data[0].embedding, dtype=np.float32)
    assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    np.testing.assert_allclose(vec, reference(hf, ids), atol=1e-5)
    # the SDK asks for base64 by default and decodes it itself
    default = client.embeddings.create(model=MODEL, input=TEXTS[0])
    np.testing.assert_array_equal(np.array(default.data[0].embedding, dtype=np.float32), vec)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=TEXTS[0], encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), vec)
    tiny_server.wait_blocks_free()


def test_lists_token_ids_and_dimensions(client, hf, tiny_server):
    tok = hf[1]
    ids = [tok(t)["input_ids"] for t in TEXTS]
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float", user="someone")
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.usage.prompt_tokens == sum(map(len, ids))
    for d, i in zip(out.data, ids, strict=True):
        np.testing.assert_allclose(d.embedding, reference(hf, i), atol=1e-5)
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")  # one input as token ids
    np.testing.assert_allclose(one.data[0].embedding, out.data[1].embedding, atol=1e-6)
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")  # a list of those
    for a, b in zip(many.data, out.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
    cut = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=16)  # truncated, renormalised
    vec = np.array(cut.data[0].embedding)
    assert vec.shape == (16,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    np.testing.assert_allclose(vec, reference(hf, ids[1], 16), atol=1e-5)
    tiny_server.wait_blocks_free()


def test_bad_requests_are_400_and_the_server_goes_on(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hi", dimensions=65)  # the hidden size is 64
    assert info.value.body["param"] == "dimensions" and "64" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=[[5] * 600])  # max_model_len is 512
    assert "maximum context length" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=[])
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hi", extra_body={"truncate_prompt_tokens": 4})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    assert len(client.embeddings.create(model=MODEL, input="still serving").data) == 1
    tiny_server.wait_blocks_free()


def test_embeddings_beside_generations_both_complete(tiny_server, hf):
    ids = hf[1](TEXTS[1])["input_ids"]

    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            gens = [c.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}) for i in range(4)]
            embs = [c.embeddings.create(model=MODEL, input=[TEXTS[1]] * 3 + [f"doc {i}"], encoding_format="float")
                    for i in range(4)]
            return await asyncio.gather(*gens, *embs)

    results = asyncio.run(run())
    gens, embs = results[:4], results[4:]
    assert all(g.usage.completion_tokens == 12 for g in gens)
    want = reference(hf, ids)
    for e in embs:
        assert len(e.data) == 4
        for d in e.data[:3]:  # the same prompt, shared through the prefix cache or not, pools alike
            np.testing.assert_allclose(d.embedding, want, atol=1e-5)
    tiny_server.wait_blocks_free()
