"""Dynamo's PreprocessedRequest to a TokenizedRequest, TokenDeltas to LLMEngineOutputs, and the
worker's counters (no Dynamo needed)."""

from __future__ import annotations

import pytest

from services.dynamo_worker.metrics import metrics_text
from services.dynamo_worker.outputs import ChoiceCounts, engine_output, error_output
from services.dynamo_worker.requests import UnsupportedRequest, tokenized_request
from shared.messages import RequestError, SchedulerStats, TokenDelta, TokenLogprob
from tests.helpers import parse_metrics


def test_request_fields_map_to_sampling_params():
    msg = tokenized_request("r1", {
        "token_ids": [5, 6, 7],
        "stop_conditions": {"max_tokens": 9, "min_tokens": 2, "ignore_eos": True, "stop_token_ids_hidden": [11],
                            "stop": ["END"]},
        "sampling_options": {"temperature": 0.0, "top_p": 0.9, "top_k": -1, "seed": 3, "n": 2,
                             "presence_penalty": 0.5, "repetition_penalty": None},
        "output_options": {"logprobs": 2},
        "eos_token_ids": [2],
    }, max_model_len=64, default_eos=[99])
    p = msg.params
    assert msg.request_id == "r1" and msg.prompt_token_ids == [5, 6, 7] and msg.eos_token_ids == [2]
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (9, 2, True, [11])
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.n, p.presence_penalty) == (0.0, 0.9, 0, 3, 2, 0.5)
    assert p.repetition_penalty == 1.0 and p.logprobs == 2
    assert p.stop == []  # stop strings are Dynamo's to find: it detokenizes


def test_defaults_fill_the_rest_of_the_context_and_the_models_eos():
    msg = tokenized_request("r", {"token_ids": [1] * 10}, max_model_len=64, default_eos=[2])
    assert msg.params.max_tokens == 54 and msg.eos_token_ids == [2] and msg.params.temperature == 1.0
    capped = tokenized_request("r", {"token_ids": [1] * 10, "stop_conditions": {"max_tokens": 500}}, 64, [2])
    assert capped.params.max_tokens == 54


@pytest.mark.parametrize("request_body", [
    {"token_ids": []},
    {"token_ids": [1, -1]},
    {"token_ids": [1] * 64},
    {"token_ids": [1], "sampling_options": {"guided_decoding": {"json": {"type": "object"}}}},
    {"token_ids": [1], "sampling_options": {"use_beam_search": True}},
])
def test_what_the_engine_cannot_do_is_refused(request_body):
    with pytest.raises(UnsupportedRequest):
        tokenized_request("r", request_body, max_model_len=64, default_eos=[2])


def test_deltas_become_engine_outputs_with_cumulative_usage():
    counts = ChoiceCounts()
    first = engine_output(TokenDelta("r", [4, 5], 7, num_cached_tokens=3), counts)
    assert first == {"token_ids": [4, 5], "index": 0}
    last = engine_output(TokenDelta("r", [6], 7, finish_reason="length",
                                    logprobs=[TokenLogprob(6, -0.5)]), counts)
    assert last["finish_reason"] == "length" and last["log_probs"] == [-0.5]
    assert last["completion_usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                        "prompt_tokens_details": {"cached_tokens": 3}}
    assert engine_output(TokenDelta("r", [], 7, finish_reason="abort"), ChoiceCounts())["finish_reason"] == "cancelled"
    assert error_output(RequestError("r", 500, "boom"))["finish_reason"] == "error: boom"


def test_metrics_text_parses():
    m = parse_metrics(metrics_text(5, 1, SchedulerStats(num_running=2, kv_blocks_used=7, prefix_cache_hits_total=32)))
    assert m["pagedserve_dynamo_requests_total"] == 5 and m["pagedserve_dynamo_requests_aborted_total"] == 1
    assert m["pagedserve_kv_blocks_used"] == 7 and m["pagedserve_prefix_cache_hits_total"] == 32
    assert "pagedserve_kv_blocks_used" not in parse_metrics(metrics_text(0, 0, None))
