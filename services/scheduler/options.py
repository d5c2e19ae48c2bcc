"""The scheduler's options (`SchedulerOptions`; its step limits are shared.config's
`BatchLimits`, which the executor is sized for too; its `SchedulingOptions`, which the
gateway takes too, so that it refuses a `priority` the scheduler would not honour), where it publishes KV cache
events (`KVEventsOptions`), and the check of those limits against the ones an executor reports it was sized for
(`fit_to_executor`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.scheduler.reservation import POLICIES as KV_POLICIES
from services.scheduler.speculation import SpeculativeConfig
from shared.config import BatchLimits
from shared.messages import ExecutorReady
from shared.options import option, positive

log = logging.getLogger("pagedserve.scheduler")

STEP_TIMEOUT_S = 120.0  # the executor answers a step within this, or it is lost
WARMUP_FACTOR = 5  # the first step after an executor announces itself may compile kernels


@dataclass(frozen=True)
class SchedulerOptions:
    """scheduler"""

    preemption_mode: str = option("recompute", "swap needs host swap space on the executor (--swap-space)",
                                  choices=("recompute", "swap"))
    prefix_caching: bool = option(True, "do not reuse cached KV blocks of identical prompt prefixes")
    kv_policy: str = option("paged", "paged (blocks on demand) or a contiguous-reservation baseline of the paper",
                            choices=KV_POLICIES)
    async_scheduling: bool = option(True, "build each step only once the previous one's result is back (by default "
                                          "the next step is built and sent while the executor runs the current one)")
    ahead_fraction: float = option(0.8, "with async scheduling and long prompts (below), build the next step "
                                        "this share of the last step's time into the one in flight (at most "
                                        "30 ms in), so that it takes in prompts that arrived meanwhile; 0 "
                                        "builds it as the step starts")
    ahead_long_prompts: float = option(0.5, "prompts count as long (--ahead-fraction applies) while they "
                                            "average at least this share of a step's token budget; 0: always")
    step_timeout: float = option(STEP_TIMEOUT_S, "seconds the executor may take to answer a step before it is "
                                                 "treated as lost (its requests are recomputed when it answers "
                                                 f"again); {WARMUP_FACTOR}x that for the first step after it "
                                                 "starts, which may compile kernels")


@dataclass(frozen=True)
class KVEventsOptions:
    """KV cache events (vLLM's KVEventBatch on ZMQ, for KV-aware routers: llm-d, Dynamo)"""

    kv_events_endpoint: str = option("", "publish the prefix cache's changes (blocks stored, removed, all cleared) "
                                         "in vLLM's KV events format on a ZMQ PUB socket bound there, e.g. "
                                         "tcp://127.0.0.1:5557; with --data-parallel-size N engine i publishes on "
                                         "port + i, as vLLM does (default: off)")
    kv_events_replay_endpoint: str = option("", "a ROUTER socket there answers requests for past batches by "
                                                "sequence number, as vLLM's replay socket (port + i per engine)")
    kv_events_topic: str = option("", "the topic frame of every event message (vLLM's default: empty)")
    kv_events_connect: bool = option(False, "connect the PUB socket to --kv-events-endpoint (a subscriber that "
                                            "binds, as llm-d's indexer) instead of binding it")
    kv_events_allow_network: bool = option(False, "allow KV event endpoints reachable from the network (they are "
                                                  "plain ZMQ, and the events carry prompts' token ids); by default "
                                                  "only loopback, ipc:// and inproc:// are allowed")


def engine_rank(engine: str) -> int:
    """The data-parallel rank of an engine named "engine-<rank>" (ValueError for another name)."""
    rank = engine.removeprefix("engine-")
    if not rank.isdigit():
        raise ValueError(f"engine {engine!r} is not named engine-<rank>: its data-parallel rank is unknown")
    return int(rank)


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulingOptions:
    """scheduling policy (the scheduler and the gateway)"""

    scheduling_policy: str = option("fcfs", "fcfs: first come, first served (a request's non-zero 'priority' is "
                                            "refused); priority: by each request's 'priority', lower first, ties "
                                            "by arrival, and a waiting request preempts running ones of a lower "
                                            "priority when it finds no room", choices=SCHEDULING_POLICIES)


def fit_to_executor(own: BatchLimits, ready: ExecutorReady) -> BatchLimits:
    """The step limits to schedule with: the scheduler's own, lowered to those the executor
    reports it was sized for (its profiling pass, its largest CUDA graph or compiled batch)
    where they are smaller, with a warning naming both. An executor that reports none (0,
    an older one) is taken at the scheduler's word."""
    seqs = min(own.max_num_seqs, ready.max_num_seqs or own.max_num_seqs)
    tokens = min(own.max_num_batched_tokens, ready.max_num_batched_tokens or own.max_num_batched_tokens)
    if (seqs, tokens) != (own.max_num_seqs, own.max_num_batched_tokens):
        log.warning("executor %s was sized for steps of --max-num-seqs %d and --max-num-batched-tokens %d, below "
                    "this scheduler's %d and %d: scheduling with %d and %d (give both stages the same limits)",
                    ready.executor_id, ready.max_num_seqs, ready.max_num_batched_tokens, own.max_num_seqs,
                    own.max_num_batched_tokens, seqs, tokens)
    return BatchLimits(seqs, tokens)


SPECULATIVE_METHODS = ("off", "ngram", "draft")
# benchmarks/speculative.py on the shared 2-core host with SmolLM2 (README): at C=1 speculation
# gained on both prompt sets, at C=4 it lost on ShareGPT-like prompts (0.63x tok/s) and gained on
# copy-heavy ones; off above 2 running sequences keeps the measured win and avoids the measured loss
SPECULATIVE_DISABLE_BATCH_SIZE = 2


@dataclass(frozen=True)
class SpeculativeOptions:
    """speculative decoding (the scheduler or a draft model proposes, the executor verifies)"""

    speculative: str = option("off", "ngram: propose the tokens that followed the latest earlier occurrence of a "
                                     "sequence's last n tokens (prompt lookup) and verify them in one step, "
                                     "losslessly (greedy and sampled output keep the model's distribution); "
                                     "draft: a smaller model with the same tokenizer (--draft-model) proposes, "
                                     "in the executor, with its own K/V on the target's blocks",
                              choices=SPECULATIVE_METHODS)
    draft_model: str | None = option(None, "the draft model of --speculative draft: a directory or a known name, "
                                           "whose vocabulary must be the model's")
    num_speculative_tokens: int = option(3, "the most tokens proposed for a sequence per step (3: a one-user step "
                                            "of 1 + 3 tokens stays on the int4 copies where their calibrated row "
                                            "limit is 4; past it a step runs on the bfloat16 weights, ~2.5x slower "
                                            "on SmolLM2)", parse=positive)
    ngram_min: int = option(2, "the shortest suffix (tokens) the ngram proposer matches", parse=positive)
    ngram_max: int = option(8, "the longest suffix (tokens) the ngram proposer matches (tried first)",
                            parse=positive)
    ngram_tokens_per_match: int = option(1, "the ngram proposer proposes at most this many tokens per token of "
                                            "the suffix it matched (a match of n tokens: at most this x n, and "
                                            "never more than --num-speculative-tokens); 0: always "
                                            "--num-speculative-tokens", parse=int)
    speculative_disable_batch_size: int = option(
        SPECULATIVE_DISABLE_BATCH_SIZE, "no proposals while more than this many sequences run (as vLLM's "
                                        "disable_by_batch_size): then a step is no longer bound by reading the "
                                        "weights and verification stops paying", parse=positive)


def speculative_config(options: SpeculativeOptions) -> SpeculativeConfig:
    """The scheduler's speculation settings from its flags (ValueError for an empty suffix range or a
    negative --ngram-tokens-per-match)."""
    if options.ngram_min > options.ngram_max:
        raise ValueError(f"--ngram-min {options.ngram_min} is above --ngram-max {options.ngram_max}")
    if options.ngram_tokens_per_match < 0:
        raise ValueError(f"--ngram-tokens-per-match must be 0 or more, got {options.ngram_tokens_per_match}")
    if (options.speculative == "draft") != (options.draft_model is not None):
        raise ValueError("--speculative draft needs --draft-model PATH, and --draft-model needs --speculative draft")
    return SpeculativeConfig(options.speculative, options.num_speculative_tokens, options.ngram_min,
                             options.ngram_max, options.speculative_disable_batch_size,
                             options.ngram_tokens_per_match)
