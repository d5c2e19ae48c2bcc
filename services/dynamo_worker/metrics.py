"""The worker's counters in Prometheus text, for Dynamo's system status server (its
/metrics, on $DYN_SYSTEM_PORT when set): requests taken and aborted here, and the engine's
scheduler stats from its latest heartbeat (requests running and waiting, KV blocks used
and total, prefix-cache lookups and hits), under the names the gateway uses."""

from __future__ import annotations

from shared.messages import SchedulerStats

_STATS = (  # (metric, SchedulerStats field, type)
    ("pagedserve_num_requests_running", "num_running", "gauge"),
    ("pagedserve_num_requests_waiting", "num_waiting", "gauge"),
    ("pagedserve_kv_blocks_used", "kv_blocks_used", "gauge"),
    ("pagedserve_kv_blocks_total", "kv_blocks_total", "gauge"),
    ("pagedserve_prefix_cache_queries_total", "prefix_cache_queries_total", "counter"),
    ("pagedserve_prefix_cache_hits_total", "prefix_cache_hits_total", "counter"),
    ("pagedserve_num_preemptions_total", "num_preemptions_total", "counter"),
)


def metrics_text(requests_total: int, aborted_total: int, stats: SchedulerStats | None) -> str:
    lines = ["# TYPE pagedserve_dynamo_requests_total counter", f"pagedserve_dynamo_requests_total {requests_total}",
             "# TYPE pagedserve_dynamo_requests_aborted_total counter",
             f"pagedserve_dynamo_requests_aborted_total {aborted_total}"]
    for name, field, kind in _STATS if stats is not None else ():
        lines += [f"# TYPE {name} {kind}", f"{name} {getattr(stats, field)}"]
    return "\n".join(lines) + "\n"
