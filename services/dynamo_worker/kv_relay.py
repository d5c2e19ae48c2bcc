"""The scheduler's KV cache events, relayed to Dynamo's KV router.

With `--kv-events-endpoint` the scheduler publishes its prefix cache's changes (blocks
stored, removed, all cleared) as vLLM's KVEventBatch on a ZMQ PUB socket (engine i on
port + i, `shared.kv_events`). Dynamo's KvEventPublisher, given that address, subscribes
to it as it does to vLLM's and forwards the events on Dynamo's event plane, under this
worker's instance id: the router then knows which worker holds which prompt prefix.
"""

from __future__ import annotations

import logging
from typing import Any

from shared.kv_events import offset_endpoint

log = logging.getLogger("pagedserve.dynamo_worker")


def engine_events_endpoint(options: Any, engine_rank: int) -> str | None:
    """Where the engine's scheduler publishes its KV events (None: it does not)."""
    if not options.kv_events_endpoint:
        return None
    if options.kv_events_connect:
        raise SystemExit("--kv-events-connect makes the scheduler connect to a subscriber that binds; Dynamo's "
                         "relay subscribes to a publisher that binds: leave --kv-events-connect off")
    return offset_endpoint(options.kv_events_endpoint, engine_rank).replace("*", "127.0.0.1")


def start_relay(endpoint: Any, events_endpoint: str, block_size: int, topic: str = "") -> Any:
    """Dynamo's relay from events_endpoint to its event plane (stop it with .shutdown())."""
    from dynamo.llm import KvEventPublisher

    relay = KvEventPublisher(endpoint=endpoint, kv_block_size=block_size, zmq_endpoint=events_endpoint,
                             zmq_topic=topic)
    log.info("relaying KV events from %s to Dynamo's router (blocks of %d tokens)", events_endpoint, block_size)
    return relay
