"""The tokenizer stage process: load the tokenizer, connect the sockets, run the loop.

A replica is a stateless worker (`stage.TokenizerStage`): messages arrive from the gateway
on tokenizer_in, through a DEALER named after this replica (the gateway deals each
request to a live replica by name), and every answer goes back to the gateway on a PUSH
to gateway_in. It has no socket to a scheduler: the gateway passes each TokenizedRequest
on to the engine it picks. Its heartbeat says "stuck" when the loop has made no turn for
STUCK_AFTER_S (a hung tokenizer call, say): the gateway then routes around it and sends
the requests still waiting for its answer to another replica. Structured output specs
compile in a pool of worker processes (`grammar_pool`) with a time limit, so that a slow
one never stalls this loop; the loop also wakes when a worker answers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time

import zmq
from transformers import AutoConfig, GenerationConfig

from services.tokenizer import grammar_pool
from services.tokenizer.prompts import PromptBuilder
from services.tokenizer.stage import TokenizerStage
from shared import cpu_placement, structured_output
from shared.config import Addresses
from shared.curve import stage_keys
from shared.heartbeat import HeartbeatThread
from shared.messages import GatewayToTokenizer, TokenizerToGateway
from shared.model_files import load_tokenizer, resolve_model
from shared.transport import DealerSocket, PushSocket, configure, wait_readable

log = logging.getLogger(__name__)

POLL_MS = 100
STUCK_AFTER_S = 5.0  # a loop turn takes at most POLL_MS when idle
BATCH = 8  # messages taken per turn before the grammar pool is polled again


def load_prompt_builder(model: str, max_model_len: int | None):
    """(tokenizer, PromptBuilder, eos token ids) for the model."""
    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    config = AutoConfig.from_pretrained(path).get_text_config()
    model_len = max_model_len or getattr(config, "max_position_embeddings", None)
    if not model_len:
        raise SystemExit(f"{path}/config.json has no max_position_embeddings: pass --max-model-len")
    vocab_size = getattr(config, "vocab_size", None) or len(tokenizer)
    eos = set(_ids(config.eos_token_id)) | set(_ids(tokenizer.eos_token_id))
    try:
        eos |= set(_ids(GenerationConfig.from_pretrained(path).eos_token_id))
    except OSError:
        pass  # no generation_config.json
    return tokenizer, PromptBuilder(tokenizer, model_len, vocab_size), sorted(eos)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def run(args: argparse.Namespace) -> int:
    addrs = Addresses.from_args(args, required=("tokenizer_in", "gateway_in", "status"))
    # The host name tells apart replicas in containers, where every pid is 1.
    replica = args.replica or f"tokenizer-{socket.gethostname()}-{os.getpid()}"
    state = "loading tokenizer"
    stop = threading.Event()
    grammars = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    ctx = configure(zmq.Context(), stage_keys(args, addrs))
    progress = _Progress()

    def health() -> str:
        stalled = progress.stalled_s()
        return state if state != "ready" or stalled < STUCK_AFTER_S else f"stuck: no progress for {stalled:.0f} s"

    heartbeat = HeartbeatThread(ctx, addrs.status, "tokenizer", replica, health)
    heartbeat.start()
    to_gateway = PushSocket(ctx, addrs.gateway_in, TokenizerToGateway, bind=False)
    from_gateway = stage = None
    try:
        tokenizer, prompts, eos = load_prompt_builder(args.model, args.max_model_len)
        if structured_output.available():  # workers start on the first constrained request
            grammars = grammar_pool.GrammarPool.for_tokenizer(
                tokenizer, prompts.vocab_size, workers=args.grammar_workers,
                timeout_s=args.grammar_compile_timeout, max_bytes=args.grammar_max_bytes)
        stage = TokenizerStage(tokenizer, prompts, eos, to_gateway.send, grammars)
        # Connected only now: the gateway deals requests to every connected replica.
        from_gateway = DealerSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer, identity=replica)
        log.info("%s ready: max_model_len=%d eos=%s", replica, prompts.max_model_len, eos)
        state = "ready"
        cpu_placement.settle()
        progress.turned()
        _serve(stage, from_gateway, stop, progress)
    finally:
        heartbeat.stop()  # a daemon thread: it owns its socket, so the context is left to exit
        pool = stage.grammars if stage is not None else grammars  # the stage may have replaced a broken one
        if pool is not None:
            pool.close()
        for sock in (from_gateway, to_gateway):
            if sock is not None:
                sock.close()
    return 0


class _Progress:
    """When the loop last turned; read by the heartbeat thread."""

    def __init__(self):
        self.at = time.monotonic()

    def turned(self) -> None:
        self.at = time.monotonic()

    def stalled_s(self) -> float:
        return time.monotonic() - self.at


def _serve(stage: TokenizerStage, from_gateway: DealerSocket, stop, progress: _Progress) -> None:
    while not stop.is_set():
        progress.turned()
        busy = stage.poll_grammars()
        for _ in range(BATCH):
            msg = from_gateway.recv(timeout_ms=0)
            if msg is None:
                break
            busy = True
            stage.handle(msg)
        if not busy:
            _wait([from_gateway], stage.grammars, POLL_MS)


def _wait(sockets: list, grammars, timeout_ms: int) -> None:
    """Until a socket has a message or a grammar worker an answer (at most timeout_ms)."""
    if grammars is None or not grammars.busy:
        wait_readable(sockets, timeout_ms)
        return
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s.sock, zmq.POLLIN)
    for fd in grammars.fds():
        poller.register(fd, zmq.POLLIN)
    poller.poll(timeout_ms)
