"""`--speculative draft --draft-model PATH` through a real server and the openai SDK, under
--deterministic on the tiny Llama: greedy tokens and logprobs with a draft model's proposals equal
those of the same requests opted out of speculation, token for token and bit for bit, with another
random model of the same vocabulary as draft and with the target as its own draft (which has
~every proposal accepted); the metrics count proposals under vLLM's names too, and every block
comes back once the requests end."""

from __future__ import annotations

import time

import openai
import pytest

from tests.helpers import ServerProcess, make_tiny_llama

PROMPTS = [
    [101, 2002, 3003, 4004, 5005, 101, 2002, 3003, 4004, 5005, 101, 2002, 3003],
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
    list(range(500, 540)),
]
MAX_TOKENS = 40


@pytest.fixture(scope="module", params=["other", "self"])
def server(request, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"draft-{request.param}")
    draft = make_tiny_llama(run_dir / "draft", seed=1, num_layers=1) if request.param == "other" else tiny_model_dir
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--deterministic", "--speculative", "draft",
             "--draft-model", str(draft), "--num-speculative-tokens", "4"]
    with ServerProcess(tiny_model_dir, run_dir, extra) as s:
        s.draft = request.param
        yield s


def greedy(server, prompt, **extra) -> tuple[list[int], list[float]]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                               extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return out.choices[0].token_ids, out.choices[0].logprobs.token_logprobs


def spec_counters(server) -> dict[str, float]:
    """The engine's speculation counters once the gateway has mirrored the last request's."""
    deadline = time.monotonic() + 5
    while True:
        m = server.metrics()
        if m.get("pagedserve_spec_decode_num_drafts_total", 0) > 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_greedy_with_a_draft_model_equals_greedy_without(server):
    plain = [greedy(server, p, speculative=False) for p in PROMPTS]
    spec = [greedy(server, p) for p in PROMPTS]
    assert spec == plain
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in spec)
    m = spec_counters(server)
    proposed, accepted = (m["pagedserve_spec_decode_num_draft_tokens_total"],
                          m["pagedserve_spec_decode_num_accepted_tokens_total"])
    assert m["pagedserve_spec_decode_num_drafts_total"] > 0 and proposed >= accepted
    assert any(k.startswith("vllm:spec_decode_num_draft_tokens_total") for k in m)
    if server.draft == "self":  # the target proposes what it then verifies
        assert accepted >= 0.95 * proposed, m
    assert "speculative decoding: draft model" in server.log_path.read_text(errors="replace")
    server.wait_blocks_free()
