"""One policy on one trace: the real `Scheduler` and allocator, a model-free executor,
and a simulated clock.

Each step the scheduler plans a batch, the step-time model says how long it takes,
and every sequence that samples gets a token (never EOS; requests run with
ignore_eos and max_tokens = their drawn output length). Between steps the clock
jumps to the next arrival when nothing can run. The simulation stops at the end of
the arrivals' window, whatever is still queued.

Time averages cover [warmup, duration]. The pool is measured between steps
(`kv_usage` after results are applied) and that state is weighted by the time until
the next measurement; the batch size of a step (running requests once it is
planned) by the step's duration; idle time counts as an unchanged pool and an
empty batch. KV shares are of the time-averaged memory in use (see
`kv_accounting`).

The reservation baselines' chunks are placed by the buddy allocator, as the paper's
Orca (`SimConfig.placement`; first fit for comparison, see `address_space`).

Prefix caching is off: the paper's baselines have none and its traces share no
prefixes. The scheduler keeps its serving limits (max_num_seqs 256, a 2048-token
budget per step, close to vLLM's 256 and 2560 of the time): in the paper's settings
no policy's batch reaches 256, and the budget only chunks long prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.kv_accounting import KVUsage, kv_usage
from services.scheduler.reservation import make_allocator
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from services.simulator.step_time import StepTimeModel
from services.simulator.workload import TraceRequest
from shared.messages import SamplingParams

EOS = 2
TOKEN = 1  # what the fake model always produces


@dataclass(frozen=True)
class SimConfig:
    kv_slots: int
    duration_s: float
    warmup_s: float = 0.0
    block_size: int = 16  # paged blocks
    # Orca and FasterTransformer reserve token slots, not blocks: 1 reproduces them;
    # the served engine's reservations are block-rounded (use block_size to see it).
    reserve_block_size: int = 1
    placement: str = "buddy"  # where reservations go (see services/scheduler/address_space.py)
    max_model_len: int = 2048  # OPT
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    step_time: StepTimeModel = field(default_factory=StepTimeModel)

    @property
    def pool_slots(self) -> int:
        """The same pool for every policy: kv_slots rounded down to whole paged blocks."""
        return self.kv_slots - self.kv_slots % self.block_size


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    usage: KVUsage  # time-averaged slots
    mean_batched_requests: float
    num_arrived: int
    num_finished: int
    num_rejected: int  # never fit the pool or max_model_len
    num_preemptions: int
    num_steps: int
    num_waiting_at_end: int
    mean_normalized_latency_s: float | None  # (finish - arrival) / output tokens, arrived after warm-up

    def as_json(self) -> dict:
        u = self.usage
        return {
            "policy": self.policy,
            "token_state_share": u.token_state_share,
            "reserved_share": u.reserved_share,
            "internal_frag_share": u.internal_frag_share,
            "external_frag_share": u.external_frag_share,
            "mean_batched_requests": self.mean_batched_requests,
            "free_share": u.free_share,
            "mean_slots": {
                "token_states": u.token_states, "reserved": u.reserved, "internal_frag": u.internal_frag,
                "external_frag": u.external_frag, "free": u.free,
            },
            "num_arrived": self.num_arrived,
            "num_finished": self.num_finished,
            "num_rejected": self.num_rejected,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "num_waiting_at_end": self.num_waiting_at_end,
            "mean_normalized_latency_s": self.mean_normalized_latency_s,
        }


class _TimeAverage:
    def __init__(self, start: float, end: float):
        self.start, self.end = start, end
        self.time = 0.0
        self.slots = [0.0] * 5
        self.batched = 0.0

    def add(self, t0: float, t1: float, usage: KVUsage, batched: int) -> None:
        w = min(t1, self.end) - max(t0, self.start)
        if w <= 0:
            return
        self.time += w
        for i, v in enumerate((usage.token_states, usage.reserved, usage.internal_frag, usage.external_frag, usage.free)):
            self.slots[i] += w * v
        self.batched += w * batched

    def usage(self) -> KVUsage:
        return KVUsage(*(s / self.time for s in self.slots)) if self.time else KVUsage(0, 0, 0, 0, 0)

    def mean_batched(self) -> float:
        return self.batched / self.time if self.time else 0.0


def build_scheduler(policy: str, cfg: SimConfig) -> Scheduler:
    bs = cfg.block_size if policy == "paged" else cfg.reserve_block_size
    allocator = make_allocator(policy, cfg.pool_slots // bs, bs, cfg.max_model_len, enable_prefix_caching=False,
                               placement=cfg.placement)
    config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len
    )
    return Scheduler(config, allocator)


def simulate(policy: str, trace: list[TraceRequest], cfg: SimConfig) -> PolicyResult:
    sched = build_scheduler(policy, cfg)
    avg = _TimeAverage(cfg.warmup_s, cfg.duration_s)
    usage = kv_usage(sched)
    latencies: list[float] = []
    t, i, arrived, finished, rejected, steps = 0.0, 0, 0, 0, 0, 0
    while t < cfg.duration_s:
        while i < len(trace) and trace[i].arrival <= t:
            tr = trace[i]
            req = Sequence(f"r{i}", [TOKEN] * tr.prompt_len,
                          SamplingParams(max_tokens=tr.output_len, ignore_eos=True), frozenset({EOS}), tr.arrival)
            i += 1
            arrived += 1
            if sched.check_fits(req) is not None:
                rejected += 1
                continue
            sched.add_request(req)
        scheduled = sched.schedule()
        if scheduled is None:  # nothing can run until the next arrival
            nxt = min(trace[i].arrival if i < len(trace) else cfg.duration_s, cfg.duration_s)
            avg.add(t, nxt, usage, 0)
            t = max(nxt, t)
            if i >= len(trace):
                break
            continue
        _, chunks = scheduled
        dt = cfg.step_time(chunks)
        avg.add(t, t + dt, usage, len(sched.running))
        results = sched.process_results(chunks, [TOKEN] * len(chunks))
        t += dt
        steps += 1
        for req, delta in results:
            if delta.finish_reason is not None:
                finished += 1
                if req.arrival_time >= cfg.warmup_s:
                    latencies.append((t - req.arrival_time) / req.num_output_tokens)
        usage = kv_usage(sched)
    return PolicyResult(
        policy=policy,
        usage=avg.usage(),
        mean_batched_requests=avg.mean_batched(),
        num_arrived=arrived,
        num_finished=finished,
        num_rejected=rejected,
        num_preemptions=sched.num_preemptions_total,
        num_steps=steps,
        num_waiting_at_end=len(sched.waiting),
        mean_normalized_latency_s=sum(latencies) / len(latencies) if latencies else None,
    )
