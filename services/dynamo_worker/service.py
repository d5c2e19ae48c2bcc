"""`pagedserve stage dynamo-worker`: serve one engine to NVIDIA Dynamo.

It binds the status address (its engine's scheduler and executor push heartbeats there,
as to a gateway) and connects to the scheduler like a gateway; once the engine is ready
(executor up, pool sized), it joins Dynamo: a DistributedRuntime on the chosen discovery
backend, the model registered on --dynamo-endpoint for tokens in (ModelInput.Tokens) as a
chat and completions model (ModelType.Chat | Completions) with the pool's block size and
size, the engine's load published (`load`), the scheduler's KV events relayed (`kv_relay`),
its counters put on Dynamo's system status server (`metrics`: /metrics on $DYN_SYSTEM_PORT)
and `generate` served (`handler`). SIGTERM or SIGINT shut the runtime down: the endpoint
stops taking requests and those in flight finish (Dynamo's graceful shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import uvloop
import zmq.asyncio

from services.dynamo_worker.engine_link import EngineLink
from services.dynamo_worker.engine_status import EngineStatus
from services.dynamo_worker.handler import GenerateHandler
from services.dynamo_worker.kv_relay import engine_events_endpoint, start_relay
from services.dynamo_worker.load import publish_load
from services.dynamo_worker.metrics import metrics_text
from services.dynamo_worker.model_info import model_info
from services.scheduler.options import engine_rank
from shared.config import Addresses
from shared.curve import stage_keys
from shared.model_files import default_served_name
from shared.transport import configure

log = logging.getLogger("pagedserve.dynamo_worker")


def import_dynamo():
    """Dynamo's modules, or a SystemExit that says how to install them."""
    try:
        import dynamo.llm as llm
        import dynamo.runtime as runtime
    except ImportError as exc:
        raise SystemExit(f"the Dynamo worker needs NVIDIA Dynamo ({exc}): pip install 'pagedserve[dynamo]' && "
                         "pip install --no-deps ai-dynamo (see README, Dynamo)") from exc
    return llm, runtime


def run(args: argparse.Namespace) -> int:
    import_dynamo()  # refuse before waiting for the engine
    addrs = Addresses.from_args(args, required=("scheduler_in", "status"))
    uvloop.run(serve(args, addrs))
    return 0


async def serve(args: argparse.Namespace, addrs: Addresses) -> None:
    llm, dyn_runtime = import_dynamo()
    loop = asyncio.get_running_loop()
    ctx = configure(zmq.asyncio.Context(), stage_keys(args, addrs))
    info = model_info(args.model, args.max_model_len)
    link = EngineLink(ctx, addrs.scheduler_in)
    status = EngineStatus(ctx, addrs.status, on_scheduler_restart=lambda: link.fail_all(
        "the engine's scheduler restarted and lost this request; please retry"))
    tasks = [asyncio.create_task(coro) for coro in (status.run(), link.run_reader(), link.run_beats())]
    relay = None
    try:
        log.info("waiting for the engine (%s) to be ready", args.engine)
        stats = await status.wait_ready(args.dynamo_ready_timeout)
        runtime = dyn_runtime.DistributedRuntime(loop, args.dynamo_discovery_backend, args.dynamo_request_plane,
                                                 event_plane=args.dynamo_event_plane)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.shutdown)
        endpoint = runtime.endpoint(args.dynamo_endpoint)
        events = engine_events_endpoint(args, engine_rank(args.engine))
        config = llm.ModelRuntimeConfig()
        config.context_length = min(info.max_model_len, args.max_model_len or info.max_model_len)
        config.total_kv_blocks = stats.kv_blocks_total
        config.max_num_seqs = args.max_num_seqs
        config.max_num_batched_tokens = args.max_num_batched_tokens
        config.kv_event_publishing_enabled = events is not None
        name = args.dynamo_model_name or default_served_name(args.model)
        handler = GenerateHandler(link, config.context_length, info.eos_token_ids)
        await llm.register_model(llm.ModelInput.Tokens, llm.ModelType.Chat | llm.ModelType.Completions, endpoint,
                                 str(info.path), name, worker_type=llm.WorkerType.Aggregated,
                                 kv_cache_block_size=stats.block_size, runtime_config=config)
        if events is not None:
            relay = start_relay(endpoint, events, stats.block_size, args.kv_events_topic)
        tasks.append(asyncio.create_task(publish_load(endpoint, status)))
        endpoint.metrics.register_prometheus_expfmt_callback(
            lambda: metrics_text(handler.requests_total, handler.aborted_total, status.stats))
        log.info("serving %s to Dynamo on %s as worker %d (%d KV blocks of %d tokens, context %d, discovery %s)",
                 name, args.dynamo_endpoint, endpoint.connection_id(), stats.kv_blocks_total, stats.block_size,
                 config.context_length, args.dynamo_discovery_backend)
        await endpoint.serve_endpoint(handler.generate, graceful_shutdown=True)
        log.info("Dynamo endpoint closed: %d requests served, %d aborted", handler.requests_total,
                 handler.aborted_total)
    finally:
        if relay is not None:
            relay.shutdown()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        link.close()
        status.close()
        ctx.destroy(linger=0)
