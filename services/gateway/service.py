"""The gateway stage process: bind the sockets, start the HTTP server on uvloop, serve.

It loads the model's tokenizer: it detokenizes every request's output itself. Background
tasks feed it: one routes the tokenizer replicas' answers and every engine's token deltas
to their requests, one beats to the schedulers (GatewayBeat), one
records the heartbeats arriving on the status socket (for /health and the watchdog)
and the pool snapshots (for /dashboard), one runs the watchdog that retries or fails
the requests of a lost stage, and one keeps the dashboard's history and subscription. The
gateway heartbeats through that same socket, so its own entry in /health proves the
status path works. SIGTERM drains: new requests get a 503, the ones in flight have
--shutdown-timeout seconds to finish, then the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import uvloop
import zmq
import zmq.asyncio
from aiohttp import web

from services.gateway.admission import Admission, api_key_from
from services.gateway.app import Gateway
from services.gateway.dashboard import DashboardHub
from services.gateway.dashboard_http import DashboardRoutes
from services.gateway.engine_client import EngineClient
from services.gateway.engine_loads import EnginePublisher, engines_report
from services.gateway.health import StageTracker
from services.gateway.host_check import HostCheck
from services.gateway.limits import RequestLimits
from services.gateway.lora_registry import LoraRegistry
from services.gateway.metrics import Metrics
from services.gateway.openai.embeddings import model_hidden_size, resolve_pooling
from services.gateway.supervision import SupervisionState
from services.gateway.watchdog import CHECK_INTERVAL_S, StageWatchdog
from shared import cpu_placement
from shared.config import Addresses
from shared.curve import CurveKeys, stage_keys
from shared.heartbeat import HeartbeatThread
from shared.lora_files import BaseShapes
from shared.lora_options import parse_lora_modules
from shared.messages import PoolSnapshot, StatusToGateway
from shared.model_files import default_served_name, load_tokenizer, resolve_model, vocab_size
from shared.options import from_args
from shared.transport import MAX_MESSAGE_BYTES, AsyncPullSocket, configure

log = logging.getLogger(__name__)

# a JSON body's msgpack message is at most this many times its size (token ids: "1," is
# two bytes of JSON and up to five of msgpack)
MESSAGE_EXPANSION = 3


def run(args: argparse.Namespace) -> int:
    addrs = Addresses.from_args(args)
    if args.max_request_bytes * MESSAGE_EXPANSION > MAX_MESSAGE_BYTES:
        # a request whose message the tokenizer's socket would drop would hang until its timeout
        raise SystemExit(f"--max-request-bytes {args.max_request_bytes} is too large for internal messages of at most "
                         f"{MAX_MESSAGE_BYTES} bytes: lower it, or raise $PAGEDSERVE_MAX_MESSAGE_BYTES to at least "
                         f"{MESSAGE_EXPANSION}x it")
    uvloop.run(serve(args, addrs, stage_keys(args, addrs)))
    return 0


def lora_registry(args: argparse.Namespace, model_dir, served: str) -> LoraRegistry:
    """The LoRA adapters registry, checked against the model's config, with --lora-modules in it."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir).get_text_config()
        base = BaseShapes.of_config(config, {served, str(args.model), str(model_dir)})
    except Exception:  # LoRA adapters are then refused (400) rather than the gateway down
        log.exception("reading %s's config for LoRA adapters", model_dir)
        base = None
    registry = LoraRegistry(base, args.max_lora_rank, served)
    registry.load_modules(parse_lora_modules(args.lora_modules), {served, str(args.model)})
    return registry


async def serve(args: argparse.Namespace, addrs: Addresses, keys: CurveKeys | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    ctx = configure(zmq.asyncio.Context(), keys)
    supervision = SupervisionState.from_env()
    served = args.served_model_name or default_served_name(args.model)
    metrics = Metrics(supervision, served)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)  # the gateway detokenizes
    client = EngineClient(ctx, addrs, tokenizer, vocab_size(model_dir, tokenizer), on_retry=metrics.retries.inc,
                          replicas=lambda: watchdog.live_tokenizers(), on_routed=metrics.observe_routed,
                          routing=args.routing)
    status = AsyncPullSocket(ctx, addrs.status, StatusToGateway, bind=True)
    tracker = StageTracker(metrics.observe_scheduler, supervision=supervision)

    def scheduler_lost(message: str) -> int:
        n = client.scheduler_lost(message)
        metrics.lost.inc(n)
        return n

    publisher = EnginePublisher(None, client.update_engines)
    watchdog = StageWatchdog(client.tokenizer_lost, scheduler_lost,
                             on_scheduler_restarted=publisher.then(client.scheduler_restarted),
                             on_engine_lost=publisher.then(client.engine_lost))
    publisher.watchdog = watchdog
    tracker.engines = lambda: engines_report(watchdog, lambda e: metrics.routed.get(e, 0))
    admission = Admission(api_key_from(args.api_key), args.max_queued_requests,
                          lambda: client.num_waiting, lambda: watchdog.missing_stage, args.metrics_public)
    gateway = Gateway(client, tracker, metrics, served, {served, args.model}, args.request_timeout, args.model,
                      admission, args.max_request_bytes, args.client_timeout, from_args(RequestLimits, args),
                      HostCheck(args.allowed_hosts, args.host), resolve_pooling(args.pooling, model_dir),
                      model_hidden_size(model_dir), reasoning_parser=args.reasoning_parser,
                      scheduling_policy=args.scheduling_policy,
                      loras=lora_registry(args, model_dir, served))
    hub = DashboardHub(metrics, client.watch_pool)
    tasks = [loop.create_task(client.run_reader()), loop.create_task(client.run_upkeep()),
             loop.create_task(_read_status(status, tracker, watchdog, hub, publisher)),
             loop.create_task(_watch(watchdog, publisher)), loop.create_task(hub.run()), loop.create_task(publisher.run())]
    app = gateway.make_app()
    DashboardRoutes(hub, args.client_timeout).add_to(app)

    access_log = logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=access_log, shutdown_timeout=args.shutdown_timeout,
        keepalive_timeout=args.client_timeout,  # also bounds the wait for a request's headers (slow clients)
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()

    sync_ctx = configure(zmq.Context(), keys)  # the heartbeat thread needs a plain socket
    heartbeat = HeartbeatThread(sync_ctx, addrs.status, "gateway", f"gateway-{os.getpid()}", lambda: "ready")
    heartbeat.start()
    cpu_placement.settle()
    log.info("serving %s on http://%s:%d%s", served, args.host, args.port,
             " (API key required)" if admission.api_key else "")
    try:
        await stop.wait()
        admission.draining = True
        hub.close()  # open dashboards end their streams instead of holding up the drain
        log.info("draining: %d requests in flight get up to %g s", client.num_in_flight, args.shutdown_timeout)
    finally:
        await runner.cleanup()  # stops listening, waits for the handlers up to shutdown_timeout
        heartbeat.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client.close()
        status.close()  # the heartbeat thread owns its socket: sync_ctx is left to process exit


async def _read_status(status: AsyncPullSocket, tracker: StageTracker, watchdog: StageWatchdog,
                       hub: DashboardHub, publisher: EnginePublisher) -> None:
    while True:
        try:
            beat = await status.recv()
            if isinstance(beat, PoolSnapshot):
                hub.record(beat)
                continue
            tracker.record(beat)
            watchdog.record(beat)
            publisher.publish_if_changed()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reading status failed")
            await asyncio.sleep(0.1)


async def _watch(watchdog: StageWatchdog, publisher: EnginePublisher) -> None:
    while True:
        await asyncio.sleep(CHECK_INTERVAL_S)
        try:
            watchdog.check()
            publisher.publish_if_changed()
        except Exception:
            log.exception("watchdog check failed")
