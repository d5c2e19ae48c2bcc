"""The engine's load, told to Dynamo's router: the KV blocks the scheduler's requests hold
(from its heartbeats, `engine_status`), published with Dynamo's WorkerMetricsPublisher
each time fresh stats come (about every 0.25 s) on the worker's endpoint; the KV router
weighs them against prefix overlap when it picks a worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.dynamo_worker.engine_status import EngineStatus

log = logging.getLogger("pagedserve.dynamo_worker")

PUBLISH_EVERY_S = 0.25


async def publish_load(endpoint: Any, status: EngineStatus) -> None:
    """Publish the engine's KV use until cancelled."""
    from dynamo.llm import WorkerMetricsPublisher

    publisher = WorkerMetricsPublisher()
    await publisher.create_endpoint(endpoint)
    seen = -1
    while True:
        stats = status.stats
        if stats is not None and status.updates != seen:
            seen = status.updates
            try:
                publisher.publish(dp_rank=0, active_decode_blocks=stats.kv_blocks_used,
                                  kv_used_blocks=stats.kv_blocks_used)
            except Exception:  # the load is advice to the router: never take the worker down for it
                log.exception("publishing the load to Dynamo failed")
        await asyncio.sleep(PUBLISH_EVERY_S)
