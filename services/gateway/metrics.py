"""Prometheus metrics the gateway exposes on /metrics, in their own registry.

Gauges mirror the schedulers' latest heartbeats (summed over the engines, and per engine
under `pagedserve_engine_*{engine=...}` with data parallelism); token and request counters and the
latency histograms are measured here, from the TextDeltas each request receives. Stage
restarts come from the launcher's state file (services/gateway/supervision.py).

vLLM's standard gauges are there too, under vLLM's names and labels, so that routers that
read a vLLM server's /metrics with their default flags read ours (the Gateway API Inference
Extension's endpoint picker, llm-d, vLLM's production-stack router): `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (the fraction of KV blocks in use,
0 to 1, as vLLM reports it despite the name), one series per engine labelled
{model_name=<served model name>, engine="<rank>"} as vLLM v1 labels them. LoRA adapters:
`pagedserve_lora_requests_running{lora_name}` and `..._waiting` (summed over the engines), and
vLLM's `vllm:lora_requests_info` (one series, its value the time it was set, labelled
`running_lora_adapters` and `waiting_lora_adapters`, comma-separated names, and `max_lora`),
which the inference extension reads to prefer a server that holds an adapter. Speculative
decoding's counters (proposals, proposed and accepted tokens) are there under ours and vLLM's
names (`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`), with the mean
accepted length (1 + accepted / drafts) as a gauge.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.gateway.output_text import TextDelta
from services.gateway.supervision import SupervisionState
from shared.messages import SchedulerStats

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _SupervisionCollector:
    """Per-stage restarts and whether a stage waits to restart, read at each scrape."""

    def __init__(self, supervision: SupervisionState):
        self.supervision = supervision

    def collect(self):
        restarts = CounterMetricFamily("pagedserve_stage_restarts", "Times the launcher restarted a stage",
                                       labels=["stage"])
        down = GaugeMetricFamily("pagedserve_stage_restarting",
                                 "1 while a stage is down, waiting for its restart (backoff)", labels=["stage"])
        restarting = self.supervision.restarting()
        for name, stage in sorted(self.supervision.stages().items()):
            restarts.add_metric([name], stage.get("restarts", 0))
            down.add_metric([name], 1.0 if name in restarting else 0.0)
        return [restarts, down]


VLLM_LABELS = ["model_name", "engine"]


def engine_label(engine: str) -> str:
    """vLLM's engine label: the engine's index ("engine-1" -> "1")."""
    return engine.removeprefix("engine-")


class Metrics:
    def __init__(self, supervision: SupervisionState | None = None, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        if supervision is not None:
            r.register(_SupervisionCollector(supervision))
        self.running = Gauge("pagedserve_num_requests_running", "Requests the scheduler is running", registry=r)
        self.waiting = Gauge("pagedserve_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.blocks_total = Gauge("pagedserve_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.blocks_used = Gauge("pagedserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_usage = Gauge("pagedserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens_total", "Tokens generated", registry=r
        )
        self.preemptions = Counter("pagedserve_num_preemptions_total", "Scheduler preemptions", registry=r)
        self.success = Counter(
            "pagedserve_request_success_total", "Requests finished, by finish reason", ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds", "Time to first output token", buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedserve_inter_token_latency_seconds", "Time between output tokens", buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
            buckets=E2E_BUCKETS, registry=r,
        )
        self.decode_steps = Counter("pagedserve_decode_steps_total", "Steps that only decoded", registry=r)
        self.decode_step_seconds = Counter(
            "pagedserve_decode_step_seconds_total",
            "Wall time of decode-only steps, from the previous step's result (or scheduling, after idling) to this one's", registry=r,
        )
        self.decode_forward_seconds = Counter(
            "pagedserve_decode_forward_seconds_total",
            "Part of the decode-only steps' wall time spent in the model's forward pass", registry=r,
        )
        self.retries = Counter(
            "pagedserve_request_retries_total", "Requests sent again because their tokenizer replica died",
            registry=r,
        )
        self.lost = Counter(
            "pagedserve_requests_lost_total", "Requests ended with a 503 because the scheduler was lost",
            registry=r,
        )
        self.rejected = Counter(
            "pagedserve_requests_rejected_total", "Requests refused before entering the pipeline, by reason",
            ["reason"], registry=r,
        )
        self.blocks_cached = Gauge(
            "pagedserve_kv_blocks_cached", "Cached KV blocks no request holds (prefix cache, evictable)", registry=r)
        self.blocks_saved = Gauge(
            "pagedserve_kv_blocks_saved_by_sharing", "Block-table entries served by blocks shared with others",
            registry=r)
        self.kv_slots = Gauge(
            "pagedserve_kv_slots", "KV pool token slots by the PagedAttention paper's Figure 2 category",
            ["category"], registry=r)
        self.prefix_queries = Counter(
            "pagedserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter(
            "pagedserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.swapped_out = Counter(
            "pagedserve_num_swapped_out", "Preemptions that moved a sequence's KV to host memory", registry=r)
        self.swapped_in = Counter(
            "pagedserve_num_swapped_in", "Swapped-out sequences whose KV came back", registry=r)
        self._totals_seen: dict[tuple[str, str], float] = {}
        self._latest: dict[str, SchedulerStats] = {}  # by scheduler replica
        # per engine (data parallelism)
        self.engine_running = Gauge("pagedserve_engine_num_requests_running", "Requests an engine runs",
                                    ["engine"], registry=r)
        self.engine_waiting = Gauge("pagedserve_engine_num_requests_waiting", "Requests waiting in an engine",
                                    ["engine"], registry=r)
        self.engine_kv_usage = Gauge("pagedserve_engine_kv_cache_usage_ratio", "Fraction of an engine's KV blocks in use",
                                     ["engine"], registry=r)
        self.engine_prefix_queries = Counter(
            "pagedserve_engine_prefix_cache_queries", "Prompt tokens an engine looked up in its prefix cache",
            ["engine"], registry=r)
        self.engine_prefix_hits = Counter(
            "pagedserve_engine_prefix_cache_hits", "Prompt tokens an engine found in its prefix cache",
            ["engine"], registry=r)
        self.engine_routed = Counter(
            "pagedserve_engine_requests_routed", "Requests the tokenizer replicas routed to an engine",
            ["engine"], registry=r)
        self.routed: dict[str, int] = {}
        # vLLM's names (see the module doc)
        self.vllm_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                  VLLM_LABELS, registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                  VLLM_LABELS, registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                   VLLM_LABELS, registry=r)
        # speculative decoding (--speculative): ours, and under vLLM's names
        self.spec_drafts = Counter("pagedserve_spec_decode_num_drafts", "Sequence steps with proposed tokens",
                                   registry=r)
        self.spec_draft_tokens = Counter("pagedserve_spec_decode_num_draft_tokens", "Tokens proposed", registry=r)
        self.spec_accepted = Counter("pagedserve_spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                     registry=r)
        self.spec_mean_length = Gauge("pagedserve_spec_decode_mean_accepted_length",
                                      "Tokens a speculating sequence step produced on average: 1 + accepted / drafts",
                                      registry=r)
        self.vllm_spec_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                        VLLM_LABELS, registry=r)
        self.vllm_spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                              VLLM_LABELS, registry=r)
        self.vllm_spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                          VLLM_LABELS, registry=r)

        self.lora_running = Gauge("pagedserve_lora_requests_running", "Requests running under a LoRA adapter",
                                  ["lora_name"], registry=r)
        self.lora_waiting = Gauge("pagedserve_lora_requests_waiting", "Requests waiting under a LoRA adapter",
                                  ["lora_name"], registry=r)
        self.vllm_lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                    ["running_lora_adapters", "max_lora", "waiting_lora_adapters"], registry=r)

    def observe_routed(self, engine: str) -> None:
        self.engine_routed.labels(engine).inc()
        self.routed[engine] = self.routed.get(engine, 0) + 1

    def observe_scheduler(self, replica: str, stats: SchedulerStats, engine: str = "engine-0") -> None:
        self._latest[replica] = stats
        every = self._latest.values()
        self.running.set(sum(s.num_running for s in every))
        self.waiting.set(sum(s.num_waiting for s in every))
        total, used = sum(s.kv_blocks_total for s in every), sum(s.kv_blocks_used for s in every)
        self.blocks_total.set(total)
        self.blocks_used.set(used)
        self.kv_usage.set(used / total if total else 0.0)
        self.engine_running.labels(engine).set(stats.num_running)
        self.engine_waiting.labels(engine).set(stats.num_waiting)
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        self.engine_kv_usage.labels(engine).set(usage)
        labels = (self.model_name, engine_label(engine))
        self.vllm_running.labels(*labels).set(stats.num_running)
        self.vllm_waiting.labels(*labels).set(stats.num_waiting)
        self.vllm_kv_usage.labels(*labels).set(usage)
        self._mirror(replica, self.engine_prefix_queries.labels(engine), stats.prefix_cache_queries_total,
                     "engine_prefix_queries")
        self._mirror(replica, self.engine_prefix_hits.labels(engine), stats.prefix_cache_hits_total,
                     "engine_prefix_hits")
        self._mirror(replica, self.preemptions, stats.num_preemptions_total)
        self._mirror(replica, self.decode_steps, stats.decode_steps_total)
        self._mirror(replica, self.decode_step_seconds, stats.decode_step_seconds_total)
        self._mirror(replica, self.decode_forward_seconds, stats.decode_forward_seconds_total)
        self._mirror(replica, self.prefix_queries, stats.prefix_cache_queries_total)
        self._mirror(replica, self.prefix_hits, stats.prefix_cache_hits_total)
        self._mirror(replica, self.swapped_out, stats.num_swapped_out_total)
        self._mirror(replica, self.swapped_in, stats.num_swapped_in_total)
        self._observe_loras()
        self._mirror_speculation(replica, labels, stats)
        self.blocks_cached.set(stats.kv_blocks_cached)
        self.blocks_saved.set(stats.kv_blocks_saved_by_sharing)
        free = stats.kv_blocks_total * stats.block_size - (
            stats.kv_slots_token_states + stats.kv_slots_reserved + stats.kv_slots_internal_frag
            + stats.kv_slots_external_frag)
        for category, slots in (("token_states", stats.kv_slots_token_states), ("reserved", stats.kv_slots_reserved),
                                ("internal_fragmentation", stats.kv_slots_internal_frag),
                                ("external_fragmentation", stats.kv_slots_external_frag), ("free", free)):
            self.kv_slots.labels(category).set(slots)

    def _observe_loras(self) -> None:
        every = list(self._latest.values())
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for stats in every:
            for name, n in stats.lora_running.items():
                running[name] = running.get(name, 0) + n
            for name, n in stats.lora_waiting.items():
                waiting[name] = waiting.get(name, 0) + n
        for gauge, counts in ((self.lora_running, running), (self.lora_waiting, waiting)):
            gauge.clear()
            for name, n in counts.items():
                gauge.labels(name).set(n)
        self.vllm_lora_info.clear()
        self.vllm_lora_info.labels(",".join(sorted(running)), str(max((s.max_loras for s in every), default=0)),
                                   ",".join(sorted(waiting))).set(time.time())
    def _mirror_speculation(self, replica: str, labels: tuple[str, str], stats: SchedulerStats) -> None:
        for ours, vllm, total in (
                (self.spec_drafts, self.vllm_spec_drafts, stats.spec_decode_num_drafts_total),
                (self.spec_draft_tokens, self.vllm_spec_draft_tokens, stats.spec_decode_num_draft_tokens_total),
                (self.spec_accepted, self.vllm_spec_accepted, stats.spec_decode_num_accepted_tokens_total)):
            self._mirror(replica, ours, total)
            self._mirror(replica, vllm.labels(*labels), total, f"vllm:{ours._name}")
        drafts = sum(s.spec_decode_num_drafts_total for s in self._latest.values())
        accepted = sum(s.spec_decode_num_accepted_tokens_total for s in self._latest.values())
        self.spec_mean_length.set(1 + accepted / drafts if drafts else 0.0)

    def _mirror(self, replica: str, counter: Counter, total: float, name: str | None = None) -> None:
        """Advance a counter to a running total the scheduler reports; a smaller total
        means the scheduler restarted and counts from zero again."""
        key = (replica, name or counter._name)
        seen = self._totals_seen.get(key, 0)
        counter.inc(total - seen if total >= seen else total)
        self._totals_seen[key] = total

    def track(self, num_choices: int = 1) -> RequestTimer:
        return RequestTimer(self, num_choices)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latency and token accounting of one request, fed with its TextDeltas."""

    def __init__(self, metrics: Metrics, num_choices: int = 1):
        self.m = metrics
        self.start = time.monotonic()
        self._last: float | None = None
        self._prompt_counted = False
        self._tokens: dict[int, int] = {}  # by choice index
        self._unfinished = num_choices

    def on_delta(self, msg: TextDelta) -> None:
        now = time.monotonic()
        if not self._prompt_counted:
            self.m.prompt_tokens.inc(msg.num_prompt_tokens)
            self._prompt_counted = True
        new = msg.num_output_tokens - self._tokens.get(msg.seq_index, 0)
        if new > 0:
            self.m.generation_tokens.inc(new)
            if self._last is None:
                self.m.ttft.observe(now - self.start)
            else:  # tokens held back and sent together share the wait evenly
                for _ in range(new):
                    self.m.itl.observe((now - self._last) / new)
            self._last = now
            self._tokens[msg.seq_index] = msg.num_output_tokens
        if msg.finish_reason is not None:
            self._unfinished -= 1
            if self._unfinished == 0:
                self.m.success.labels(finish_reason=msg.finish_reason).inc()
                self.m.e2e.observe(now - self.start)
