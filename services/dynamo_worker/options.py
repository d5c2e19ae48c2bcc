"""The Dynamo worker's options: where it registers (namespace, component, endpoint, model
name) and how it reaches Dynamo (discovery backend, request and event planes)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shared.options import option

DISCOVERY_BACKENDS = ("file", "etcd", "mem", "kubernetes")


@dataclass(frozen=True)
class DynamoOptions:
    """dynamo worker (`pagedserve serve --dynamo`, `pagedserve stage dynamo-worker`)"""

    dynamo_endpoint: str = option("dyn://dynamo.backend.generate",
                                  "the endpoint this worker serves, dyn://NAMESPACE.COMPONENT.ENDPOINT; the "
                                  "frontend finds every worker of a model there")
    dynamo_model_name: str | None = option(None, "model name registered with Dynamo (default: the served model name "
                                                 "`serve` uses, from --model)")
    dynamo_discovery_backend: str = option(
        "etcd", "file: a directory on this host ($DYN_FILE_KV, else $TMPDIR/dynamo_store_kv), no services needed; "
                "etcd: $ETCD_ENDPOINTS (with --dynamo-event-plane nats: $NATS_SERVER)",
        choices=DISCOVERY_BACKENDS, default_factory=lambda: os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"))
    dynamo_request_plane: str = option("tcp", "how Dynamo's frontend sends requests here", choices=("tcp", "nats"),
                                       default_factory=lambda: os.environ.get("DYN_REQUEST_PLANE", "tcp"))
    dynamo_event_plane: str | None = option(None, "how KV events and load reach the router (default: Dynamo's, zmq "
                                                  "with file discovery, nats with etcd)", choices=("zmq", "nats"),
                                            default_factory=lambda: os.environ.get("DYN_EVENT_PLANE"))
    dynamo_ready_timeout: float = option(600.0, "seconds to wait for the engine (executor up, pool sized) before "
                                                "registering with Dynamo")
