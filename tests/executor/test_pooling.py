"""Embedding rows in the ModelRunner: the pooled vector of a prompt (whole or in chunks, mean,
last or cls) against transformers' own final hidden states, next to a sampled row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.executor.model_runner import ModelRunner
from shared.messages import ExecuteStep
from tests.executor.test_model_runner import BLOCK, Driver, make_model, prompts


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("untied")
    return path, make_model(path, "untied")


def hf_hidden(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()  # after the final norm


def expected(hf, prompt, kind) -> np.ndarray:
    h = hf_hidden(hf, prompt)
    v = {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[kind]
    return torch.nn.functional.normalize(v, dim=0).numpy()


def vector(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4")


@pytest.mark.parametrize("kind", ["mean", "last", "cls"])
def test_pooled_prompt_matches_transformers_whole_and_chunked(llama, kind):
    path, hf = llama
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    drv = Driver(runner)
    whole, chunked, gen = prompts(3, [21, 30, 9])
    drv.add("whole", whole)
    drv.add("chunked", chunked)
    drv.add("gen", gen)
    # step 1: the whole prompt ends, the chunked one's first 13 tokens, a generation samples
    seqs = [drv.chunk("whole", sample=False), drv.chunk("chunked", 13, sample=False), drv.chunk("gen")]
    r1 = runner.run(ExecuteStep(1, seqs, pooling=[(0, kind, True), (1, kind, False)]))
    assert r1.failed == [] and r1.sampled[:2] == [-1, -1] and r1.sampled[2] >= 0
    assert len(r1.embeddings) == 1
    np.testing.assert_allclose(vector(r1.embeddings[0]), expected(hf, whole, kind), atol=2e-5)
    assert np.linalg.norm(vector(r1.embeddings[0])) == pytest.approx(1.0, abs=1e-5)
    r2 = runner.run(ExecuteStep(2, [drv.chunk("chunked", sample=False)], pooling=[(0, kind, True)]))
    np.testing.assert_allclose(vector(r2.embeddings[0]), expected(hf, chunked, kind), atol=2e-5)
    assert len(runner.pooler) == 0  # nothing held once the prompt ended


def test_a_chunk_that_does_not_follow_fails_its_row_alone(llama):
    path, _ = llama
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    drv = Driver(runner)
    a, b = prompts(4, [20, 12])
    drv.add("a", a, computed=0)
    drv.add("b", b)
    drv.chunk("a", 8, sample=False)  # never run: the state for positions 0..7 is missing
    seqs = [drv.chunk("a", sample=False), drv.chunk("b", sample=False)]
    result = runner.run(ExecuteStep(1, seqs, pooling=[(0, "mean", True), (1, "mean", True)]))
    assert [f.index for f in result.failed] == [0] and "position 8" in result.failed[0].message
    assert result.embeddings[0] == b"" and len(vector(result.embeddings[1])) == 64


def test_released_request_drops_its_partial_state(llama):
    path, _ = llama
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    drv = Driver(runner)
    (a,) = prompts(5, [20])
    drv.add("a", a)
    runner.run(ExecuteStep(1, [drv.chunk("a", 8, sample=False)], pooling=[(0, "mean", False)]))
    assert len(runner.pooler) == 1
    runner.run(ExecuteStep(2, [], released=[("a", 0)]))
    assert len(runner.pooler) == 0
