"""The tokenizer stage process: load the tokenizer, connect the sockets, run the loop.

Requests arrive from the gateway on tokenizer_in, through a DEALER named after this
replica (the gateway routes each request, and its abort, to a replica by name). It talks
to the scheduler through another DEALER of that name, so the scheduler's replies for
the requests it forwarded come back to it. Its heartbeat says "stuck" when the loop has
made no turn for STUCK_AFTER_S (a hung tokenizer call, say): the gateway then routes
around it and replays its requests elsewhere. Scheduler messages are served first: they carry
tokens users are waiting for, while a new prompt can wait a moment. Each new request is
acknowledged to the gateway with this process's instance id, so that the gateway can
retry the requests of a replica that dies. With several engines (data parallelism,
--scheduler-in a comma-separated list, one address per engine) it routes each request
to one of them (`engine_links.EngineLinks`, `engine_router.EngineRouter`), by the engines'
loads the gateway sends (EngineLoads). When the gateway that sent requests is gone (a
new gateway instance, or its GatewayBeats stop: `gateway_watch`), their aborts go to the
scheduler, so a dead gateway's requests stop generating. Structured output specs compile
in a pool of worker processes (`grammar_pool`) with a time limit, so that a slow one never
stalls this loop.
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
from services.gateway.engine_links import EngineLinks
from services.scheduler.gateway_watch import GatewayWatch
from services.tokenizer.prompts import PromptBuilder
from services.tokenizer.stage import TokenizerStage
from shared import structured_output
from shared.config import Addresses
from shared.curve import stage_keys
from shared.heartbeat import INSTANCE_ID, HeartbeatThread
from shared.messages import (
    EngineLoads,
    GatewayBeat,
    GatewayToTokenizer,
    GenerateRequest,
    RequestAccepted,
    TokenizerToGateway,
)
from shared.model_files import load_tokenizer, resolve_model
from shared.transport import DealerSocket, PushSocket, configure, wait_readable

log = logging.getLogger(__name__)

POLL_MS = 100
STUCK_AFTER_S = 5.0  # a loop turn takes at most POLL_MS when idle
GATEWAY_BATCH = 8  # new requests taken per turn before looking at the scheduler again
GATEWAY_CHECK_S = 0.25  # how often the gateway's liveness is looked at


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
    addrs = Addresses.from_args(args)
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
    scheduler = EngineLinks(ctx, addrs.scheduler_in.split(","), replica, args.routing, to_gateway.send)
    from_gateway = None
    try:
        tokenizer, prompts, eos = load_prompt_builder(args.model, args.max_model_len)
        grammars = None
        if structured_output.available():  # workers start on the first constrained request
            grammars = grammar_pool.GrammarPool.for_tokenizer(
                tokenizer, prompts.vocab_size, workers=args.grammar_workers,
                timeout_s=args.grammar_compile_timeout, max_bytes=args.grammar_max_bytes)
        stage = TokenizerStage(tokenizer, prompts, eos, to_gateway.send, scheduler.send, grammars)
        # Connected only now: the gateway deals requests to every connected replica.
        from_gateway = DealerSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer, identity=replica)
        log.info("%s ready: max_model_len=%d eos=%s", replica, prompts.max_model_len, eos)
        state = "ready"

        def accepted(request_id: str) -> None:
            to_gateway.send(RequestAccepted(request_id, replica, INSTANCE_ID))

        progress.turned()
        _serve(stage, from_gateway, scheduler, stop, accepted, progress)
    finally:
        heartbeat.stop()  # a daemon thread: it owns its socket, so the context is left to exit
        if grammars is not None:
            grammars.close()
        for sock in (from_gateway, to_gateway, scheduler):
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


def _serve(stage: TokenizerStage, from_gateway: DealerSocket, scheduler: EngineLinks, stop, accepted,
           progress: _Progress) -> None:
    gateways = GatewayWatch()
    next_check = 0.0

    def gateways_gone(instances: set[str], why: str) -> None:
        if instances:
            n = stage.abort_gateway(instances)
            log.warning("gateway instance %s %s: aborted its %d requests", ",".join(sorted(instances)), why, n)

    while not stop.is_set():
        progress.turned()
        busy = stage.poll_grammars()
        for msg in scheduler.recv_nowait():
            stage.handle_scheduler(msg)
            busy = True
        for _ in range(GATEWAY_BATCH):
            msg = from_gateway.recv(timeout_ms=0)
            if msg is None:
                break
            busy = True
            if isinstance(msg, GatewayBeat):
                gateways_gone(gateways.heard(msg.instance), "replaced by a new one")
                continue
            if isinstance(msg, EngineLoads):
                scheduler.update(msg)
                continue
            if isinstance(msg, GenerateRequest):
                gateways_gone(gateways.heard(msg.gateway_instance), "replaced by a new one")
                accepted(msg.request_id)
            stage.handle_gateway(msg)
        now = time.monotonic()
        if now >= next_check:
            next_check = now + GATEWAY_CHECK_S
            gateways_gone(gateways.expired(), f"silent for over {gateways.lost_after_s:.0f} s")
        scheduler.forget_finished(stage.active)
        if not busy:
            _wait([from_gateway, *scheduler.sockets.values()], stage.grammars, POLL_MS)


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
