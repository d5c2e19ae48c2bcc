"""Speculative decoding through a real server (`--speculative ngram`) and the openai SDK: greedy
output equals transformers' generate token for token, with and without the per-request opt-out,
proposals are accepted (the metrics say so, under vLLM's names too), streaming gives the same
tokens as one answer, and a seeded sampled request repeats itself."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.reference import hf_greedy
from tests.helpers import ServerProcess

PROMPTS = [
    [101, 2002, 3003, 4004, 5005, 101, 2002, 3003, 4004, 5005, 101, 2002, 3003],
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("spec"),
                       ["--dtype", "float32", "--served-model-name", "tiny-llama", "--speculative", "ngram",
                        "--num-speculative-tokens", "4"]) as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def greedy(server, prompt, **extra) -> list[int]:
    out = client(server).completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return out.choices[0].token_ids


def test_greedy_with_speculation_equals_transformers_and_accepts_proposals(server, tiny_model_dir):
    expected = hf_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)
    assert [greedy(server, p) for p in PROMPTS] == expected
    assert [greedy(server, p, speculative=False) for p in PROMPTS] == expected
    deadline = time.monotonic() + 5
    while (m := server.metrics()).get("pagedserve_spec_decode_num_accepted_tokens_total", 0) == 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["pagedserve_spec_decode_num_draft_tokens_total"] >= m["pagedserve_spec_decode_num_accepted_tokens_total"]
    assert any(k.startswith("vllm:spec_decode_num_accepted_tokens_total") for k in m)
    server.wait_blocks_free()


def test_streamed_speculation_gives_the_same_tokens(server):
    whole = client(server).completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
    stream = client(server).completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text


def test_seeded_sampling_repeats_with_speculation(server):
    def sample():
        out = client(server).completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                 temperature=0.8, seed=42,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        return out.choices[0].token_ids
    assert sample() == sample()
