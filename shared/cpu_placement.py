"""Where the processes of a one-host CPU deployment run: the executor's main thread keeps
one core to itself, and everything else (its OpenMP workers, its socket and heartbeat
threads, the gateway, tokenizer and scheduler) shares the other cores.

The main thread runs each step's Python between forward passes (metadata, sampling,
messages) and its own share of every OpenMP region. Left floating, the other stages,
which wake on every step, often land on its core: the step's Python waits for them,
and so does the whole OpenMP team at its next barrier. Kept off its core, they preempt
a worker instead, which costs the team no more than before, and the step's Python is
never delayed. On the 2-core AVX2 host (`python -m benchmarks.placement --variants
default,unpinned`, 3 rounds in rotation, medians), the share of a decode step spent outside
the forward pass: 4.5% against 6.8% at C=1, 2.1% against 4.3% at C=16, 1.5% against 2.3%
at C=64 (and 2.2% against 5.2% at C=16 in a 5-round run). Throughput differences stayed
within the host's drift (tok/s 1.07x, 0.94x and 1.08x at C=1, 16, 64; 0.96x at C=16 over 5
rounds); four interleaved pairs of C=1 runs with the service's own counters gave decode
steps 5-19% shorter.

`serve` applies it (its `--cpu-placement auto`) only where one engine of one rank runs
on the CPU with at least two cores allowed: several executors on one host would all
claim the same core.

Placement starts once a stage is ready, not at its start: while the stages load
(imports, tokenizer, weights) every core is free to all of them. Pinned from the start,
the tokenizer, gateway and scheduler loaded on one core while the other idled once the
executor had its weights: a tiny model's server was healthy after 14 s instead of 8.
The launcher names a stage's cores in STAGE_CPUS_ENV; the stage calls `settle` when ready.
"""

from __future__ import annotations

import os
import threading

STAGE_CPUS_ENV = "PAGEDSERVE_STAGE_CPUS"  # "1,2,3": the cores a stage moves to once ready

_shared: set[int] | None = None  # the cores for every thread but the main one, once kept


def split(allowed: set[int] | None = None) -> tuple[int, set[int]] | None:
    """(the main thread's core, the cores for everything else) from the allowed cores
    (this thread's, by default); None when fewer than two are allowed."""
    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    if len(cpus) < 2:
        return None
    return cpus[0], set(cpus[1:])


def stage_cpus_env(cpus: set[int]) -> dict[str, str]:
    """The environment that tells a stage its cores."""
    return {STAGE_CPUS_ENV: ",".join(map(str, sorted(cpus)))}


def settle() -> set[int] | None:
    """Move every thread of this process to the cores the launcher named for it (none
    named: nothing moves); threads and processes started later inherit them."""
    named = os.environ.get(STAGE_CPUS_ENV)
    if not named:
        return None
    cpus = {int(c) for c in named.split(",")}
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return cpus


def keep_core_for_main_thread() -> tuple[int, set[int], int] | None:
    """Pin the calling (main) thread to the first allowed core and every other thread of
    this process to the rest; returns (that core, the rest, threads moved), or None where
    fewer than two cores are allowed. Threads started later call `join_shared_cores`:
    they would otherwise inherit the main thread's single core."""
    global _shared
    parts = split()
    if parts is None:
        return None
    core, rest = parts
    main = threading.get_native_id()
    moved = 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == main:
            continue
        try:
            os.sched_setaffinity(tid, rest)
            moved += 1
        except OSError:  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, {core})  # 0: the calling thread only
    _shared = rest
    return core, rest, moved


def join_shared_cores() -> None:
    """Run the calling thread on the shared cores, where the main thread keeps a core."""
    if _shared is not None:
        os.sched_setaffinity(0, _shared)
