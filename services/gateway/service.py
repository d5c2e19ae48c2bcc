"""The gateway stage process: bind the sockets, start the HTTP server on uvloop, serve.

Two background tasks feed it: one routes gateway_in messages to their requests, one
records the heartbeats arriving on the status socket. The gateway heartbeats through
that same socket, so its own entry in /health proves the status path works.
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

from services.gateway.app import Gateway
from services.gateway.engine_client import EngineClient
from services.gateway.health import StageTracker
from services.gateway.metrics import Metrics
from shared.config import Addresses, add_address_args, add_log_args, add_model_args
from shared.heartbeat import HeartbeatThread
from shared.messages import StatusToGateway
from shared.model_files import default_served_name
from shared.transport import AsyncPullSocket

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # for requests in flight at SIGTERM; the launcher kills after 10 s


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_model_args(parser)
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: from --model)")
    parser.add_argument(
        "--request-timeout", type=float, default=600.0,
        help="seconds a request may take before it is aborted with a 504",
    )
    add_address_args(parser, required=False)
    add_log_args(parser)



def run(args: argparse.Namespace) -> int:
    addrs = Addresses.from_args(args)
    uvloop.run(serve(args, addrs))
    return 0


async def serve(args: argparse.Namespace, addrs: Addresses) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    ctx = zmq.asyncio.Context()
    client = EngineClient(ctx, addrs)
    status = AsyncPullSocket(ctx, addrs.status, StatusToGateway, bind=True)
    metrics = Metrics()
    tracker = StageTracker(metrics.observe_scheduler)
    served = args.served_model_name or default_served_name(args.model)
    gateway = Gateway(client, tracker, metrics, served, {served, args.model}, args.request_timeout, args.model)
    tasks = [loop.create_task(client.run_reader()), loop.create_task(_read_status(status, tracker))]

    access_log = logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None
    runner = web.AppRunner(
        gateway.make_app(), handler_cancellation=True, access_log=access_log, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()

    sync_ctx = zmq.Context()  # the heartbeat thread needs a plain socket
    heartbeat = HeartbeatThread(sync_ctx, addrs.status, "gateway", f"gateway-{os.getpid()}", lambda: "ready")
    heartbeat.start()
    log.info("serving %s on http://%s:%d", served, args.host, args.port)
    try:
        await stop.wait()
    finally:
        heartbeat.stop()
        await runner.cleanup()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client.close()
        status.close()  # the heartbeat thread owns its socket: sync_ctx is left to process exit


async def _read_status(status: AsyncPullSocket, tracker: StageTracker) -> None:
    while True:
        try:
            tracker.record(await status.recv())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reading status failed")
            await asyncio.sleep(0.1)
