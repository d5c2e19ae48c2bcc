"""torch.compile (inductor) of the CPU decode forward pass, one graph per bucketed batch size (`--compile`).

Opt-in. A decode step of n sequences (one new token each) runs the compiled graph of the
smallest bucket >= n (the sizes of `cuda_graphs`: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
max_num_seqs); prefill, mixed and larger steps stay eager. As for CUDA graphs, the step's
inputs are copied into static buffers, so each bucket's graph always sees the same tensors
and shapes (`dynamic=False`: no symbolic sizes, one specialised graph per bucket; `dynamic`
compiles one graph for every bucket instead: measured on SmolLM2, 31 s once against 10-19 s
per bucket, cold, on a loaded 2-core host; the benchmark compares their steps; `options`
are inductor's, e.g. {"cpp_wrapper": True}, also left to the benchmark to judge). The
padding rows past n must not touch any sequence's KV: they write their K/V into a scratch
block just past the pool the scheduler knows (the runner allocates it: `SCRATCH_BLOCKS`)
and attend over that one token; their logits are never read. The block table is as wide
as the longest context allowed; the kernels read only a row's own context of it. The
quantized copies' row limits (`--quantization`) are compared with the bucket, not n: the
same choice as eager wherever the limit is itself a bucket size (the calibrated ones are);
an `--int4-max-rows` between two buckets sends the padded steps above it to dense weights.

The kernels stay whole nodes of the graph (`kernels.custom_ops`); inductor fuses what lies
between them. A bucket is compiled on its first step (lazily: a bucket never used costs
nothing), or all at start with `compile_all`. Inductor's FX graph cache and AOT autograd
cache live under the pagedserve cache (`cache_dir`), so a restart skips inductor's code
generation and C++ builds (dynamo still traces the model once per bucket). Each compile
is logged with its time and whether the caches were hit. A compile that fails leaves
that bucket eager (logged), never the step failed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from services.executor.batch import BatchMetadata
from services.executor.cuda_graphs import capture_sizes
from shared.messages import ExecuteStep

log = logging.getLogger(__name__)

SCRATCH_BLOCKS = 1  # blocks the runner adds past the scheduler's pool for the padding rows' K/V
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_dir() -> Path:
    """Where inductor keeps its caches: $TORCHINDUCTOR_CACHE_DIR if the user set it, else the
    pagedserve cache (inductor itself sets the variable to its /tmp default once it has run)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from shared.model_files import cache_root

    env = os.environ.get(CACHE_ENV)
    if env and os.path.abspath(env) != os.path.abspath(default_cache_dir()):
        return Path(env)
    return cache_root() / "inductor"


def use_cache_dir() -> Path:
    """Point inductor's caches (FX graph, AOT autograd, its C++ builds) at `cache_dir()`."""
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(path)
    return path


@dataclass
class CompileRecord:
    """One bucket's compile: seconds of its first call and the cache counters it moved."""

    size: int
    seconds: float
    fx_graph_cache_hits: int
    fx_graph_cache_misses: int
    autograd_cache_hits: int

    @property
    def cache_hit(self) -> bool:
        return self.fx_graph_cache_misses == 0 and (self.fx_graph_cache_hits > 0 or self.autograd_cache_hits > 0)


def _cache_counters() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    return (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"],
            counters["aot_autograd"]["autograd_cache_hit"])


class CompiledDecode:
    """Same interface as `cuda_graphs.DecodeGraphs` (`fits`, `replay`), for the CPU."""

    def __init__(self, model: nn.Module, k_caches: list[Tensor], v_caches: list[Tensor], block_size: int,
                 max_model_len: int, max_batch: int, scratch_block: int, dynamic: bool = False,
                 options: dict | None = None):
        if k_caches[0].shape[0] <= scratch_block:
            raise ValueError(f"scratch block {scratch_block} outside a pool of {k_caches[0].shape[0]} blocks")
        self.sizes = capture_sizes(max_batch)
        self.block_size = block_size
        self.scratch_block = scratch_block
        use_cache_dir()
        limit = len(self.sizes) + 8  # one graph per bucket, all on the model's forward
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long)
        self.positions = torch.zeros(n, dtype=torch.long)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long)
        self.context_lens = torch.ones(n, dtype=torch.long)
        self.block_tables = torch.full((n, -(-max_model_len // block_size)), scratch_block, dtype=torch.long)
        self.rows = torch.arange(n + 1)
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        model.cos_sin(model.head_weight().dtype)  # the rotary table exists before tracing (no side effect in the graph)
        self.forward = torch.compile(model, dynamic=dynamic, fullgraph=False, options=options)
        self.metas = {size: self._meta(size) for size in self.sizes}
        if dynamic:  # one graph with a symbolic batch size (benchmarks.compile_decode --dynamic)
            for meta in self.metas.values():
                for t in (meta.input_ids, meta.positions, meta.slot_mapping, meta.query_start_loc,
                          meta.context_lens, meta.block_tables, meta.sample_indices):
                    torch._dynamo.mark_dynamic(t, 0)
        self.compiled: dict[int, CompileRecord] = {}
        self.failed: set[int] = set()

    def _meta(self, size: int) -> BatchMetadata:
        return BatchMetadata(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.rows[: size + 1], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], sample_indices=self.rows[:size], sampled_seqs=list(range(size)),
            query_lens=[1] * size, decode_seqs=list(range(size)), block_size=self.block_size,
        )

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def fits(self, step: ExecuteStep) -> bool:
        return (0 < len(step.seqs) <= self.sizes[-1]
                and all(len(s.token_ids) == 1 for s in step.seqs)
                and max(len(s.block_table) for s in step.seqs) <= self.block_tables.shape[1]
                and self.bucket(len(step.seqs)) not in self.failed)

    def compile_all(self) -> list[CompileRecord]:
        """Compile every bucket now (each on a step of padding rows only); returns their records."""
        with torch.inference_mode():  # as `replay` runs: grad mode is part of the graphs' guards
            for size in self.sizes:
                if size not in self.compiled and size not in self.failed:
                    self._set_padding(0, size)
                    self._run(size)
        return [self.compiled[s] for s in self.sizes if s in self.compiled]

    def _set_padding(self, start: int, end: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(self.scratch_block * self.block_size)
        self.context_lens[start:end].fill_(1)
        self.block_tables[start:end, 0].fill_(self.scratch_block)

    def _run(self, size: int) -> Tensor:
        meta = self.metas[size]
        if size in self.compiled:
            return self.forward(meta, self.k_caches, self.v_caches)
        before = _cache_counters()
        start = time.perf_counter()
        try:
            logits = self.forward(meta, self.k_caches, self.v_caches)
        except Exception as exc:  # an inductor failure must not fail serving: this bucket runs eagerly
            log.warning("torch.compile of the decode step for batch %d failed (%s: %s); it runs eagerly",
                        size, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.failed.add(size)
            return self.model(meta, self.k_caches, self.v_caches)
        seconds = time.perf_counter() - start
        after = _cache_counters()
        record = CompileRecord(size, seconds, *(a - b for a, b in zip(after, before, strict=True)))
        self.compiled[size] = record
        log.info("compiled the decode step for batch %d in %.1f s (inductor cache %s: FX graph hits %d, misses %d; "
                 "AOT autograd hits %d) in %s", size, seconds, "hit" if record.cache_hit else "miss",
                 record.fx_graph_cache_hits, record.fx_graph_cache_misses, record.autograd_cache_hits, cache_dir())
        return logits

    def replay(self, meta: BatchMetadata) -> Tensor:
        """Float32 logits of meta's sampled sequences; meta is a decode batch that `fits`, on the CPU."""
        n = meta.num_seqs
        size = self.bucket(n)
        width = meta.block_tables.shape[1]
        with torch.inference_mode():
            self.input_ids[:n].copy_(meta.input_ids)
            self.positions[:n].copy_(meta.positions)
            self.slot_mapping[:n].copy_(meta.slot_mapping)
            self.context_lens[:n].copy_(meta.context_lens)
            # entries past a row's width are stale but valid block ids, beyond its context: never read
            self.block_tables[:n, :width].copy_(meta.block_tables)
            self._set_padding(n, size)
            return self._run(size)[meta.sampled_seqs]
