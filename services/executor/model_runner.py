"""ModelRunner: owns the model, the KV pool and the sampler, and executes one step at a time.

A step is: copy-on-write block copies, then one forward pass over every scheduled
sequence's new tokens (their K/V land in the pool at the slots the scheduler chose),
then sampling of the sequences that asked for a token. `run` returns the whole
`StepResult`: the tokens, the beams' candidates, the logprobs asked for (see
`logprobs`) and the scored prompt positions of the sequences that score their prompt
(logits are computed at those positions only for them). Sequences with structured
output sample under their grammar's token mask (`grammar`), filled during the forward pass.
A sequence with proposed tokens (speculative decoding) has each of its last 1 + k positions
sampled, and keeps the proposals its samples agree with (`speculative`). With a draft model
(`draft_model`, on one process only) the proposals of the sequences that ask are made here, after
the step's block moves and before its forward pass; the draft's K/V pool has the target's blocks,
so a pool sized by memory has as many blocks as the two models' K/V per block allow.

What is computed per sequence after the forward pass (grammar masks, logits processors,
sampling, logprobs, prompt scoring) fails only that sequence: the step's result lists it
in `failed` (sampled -1; 400 when its own constraints leave no token, 500 otherwise)
and the other rows are exactly what they would be without it. Batched work that raises
is redone row by row to find the culprits (rare, so no per-row cost otherwise). A forward
pass or block move that raises still fails the whole step (the caller answers StepFailed).

On CUDA the pool, unless sized explicitly, takes what a profiling pass of the
largest step leaves of `gpu_memory_utilization` of the GPU (see `gpu_memory`), and
decode steps replay CUDA graphs when the attention backend allows it. On the CPU,
`compile_decode` (`--compile`) runs decode steps through torch.compile instead
(`compiled_decode`: one graph per bucketed batch size, a scratch block past the pool).

Under tensor parallelism (`tp`, see `tp_group`) every rank holds a runner over its
shard of the model and its KV heads' share of the pool. The pool's block count is the
least any rank's budget allows (`TPGroup.min_int`), as is the swap space's, so one
block table addresses every rank's pool alike. Every rank runs each step's block moves
and forward pass; only rank 0 samples (the others' `run` returns an empty result).
CUDA graphs are off under tensor parallelism (no collectives inside a captured graph).

Rows under LoRA adapters (`lora_slots`) run eagerly (no CUDA graph or compiled step); an
adapter that cannot be loaded fails its rows alone (400). Under tensor parallelism each rank
holds its share of every adapter, cut as its shard of the model (`lora_shard`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from kernels.attention import get_backend
from services.executor.batch import BatchMetadata, InvalidStep
from services.executor.compiled_decode import SCRATCH_BLOCKS, CompiledDecode
from services.executor.cuda_graphs import DecodeGraphs
from services.executor.deterministic import make_batch_invariant
from services.executor.draft_model import DraftProposer, vocabulary_problem
from services.executor.dtype_choice import resolve_dtype, resolve_kv_cache_dtype
from services.executor.gpu_memory import kv_cache_budget, profile_step
from services.executor.grammar import GrammarMasks
from services.executor.host_kv_cache import HostKVCache
from services.executor.kv_cache import DEFAULT_KV_CACHE_MEMORY, KVCache, bytes_per_block
from services.executor.loader import load_model
from services.executor.logits_processors import History
from services.executor.logprobs import token_logprobs
from services.executor.lora_slots import ExecutorLoras
from services.executor.models.llama import head_dim_of
from services.executor.options import ExecutorOptions
from services.executor.pooling import Pooler
from services.executor.quantization import ALL_ROWS
from services.executor.sampler import Sampler, no_token_problem
from services.executor.speculative import row_output_indices, sampled_rows, settle
from services.executor.step_calibration import calibrate_runner
from services.executor.tp_group import GroupBroken, TPGroup
from shared import cpu_placement
from shared.lora_files import BaseShapes
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep, FailedRow, StepResult, TokenLogprob
from shared.options import with_values

log = logging.getLogger(__name__)


def _checkpoint_dtype(model_dir: str | Path) -> str | None:
    try:
        import json

        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("torch_dtype") or config.get("dtype")


class ModelRunner:
    def __init__(self, model_dir: str | Path, options: ExecutorOptions | None = None, *, tp: TPGroup | None = None,
                 seed: int | None = None, lora_options: LoraOptions | None = None,
                 draft_model: str | Path | None = None, **overrides):
        """options: the executor's (its defaults if None); overrides: some of its fields by name
        (`ModelRunner(path, dtype="float32", num_kv_blocks=64)`); lora_options: its LoRA slots';
        draft_model: the directory of a draft model for speculative decoding (`draft_model`)."""
        self.options = o = with_values(options or ExecutorOptions(), **overrides)
        block_size, num_kv_blocks, kv_cache_memory = o.block_size, o.num_kv_blocks, o.kv_cache_memory
        max_num_seqs = o.limits.max_num_seqs
        self.tp = tp or TPGroup.single()
        self.device = torch.device(o.device)
        if self.device.type == "cuda":
            if self.device.index is not None:
                torch.cuda.set_device(self.device)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(o.dtype, self.device, _checkpoint_dtype(model_dir))
        self.block_size = block_size
        self.backend = get_backend(o.attention_backend, o.device)
        # on one CPU process the quantized copies' row limits are timed on real decode steps once the
        # pool exists (services.executor.step_calibration); until then they serve every calibrated size
        # (not under --deterministic, whose quantized copies serve every step or none)
        step_calibrated = (o.int4_max_rows is None and self.tp.size == 1 and self.device.type == "cpu"
                           and not o.deterministic)
        self.model = load_model(model_dir, self.dtype, self.device, self.backend, o.quantization,
                                ALL_ROWS if step_calibrated or o.deterministic else o.int4_max_rows, self.tp,
                                prepack="none" if o.deterministic else o.prepack)
        if o.deterministic:
            for line in make_batch_invariant(self.model):
                log.info(line)
        self.kv_dtype = resolve_kv_cache_dtype(o.kv_cache_dtype, self.dtype, self.backend.name)
        config = self.model.config
        self.max_model_len: int = config.max_position_embeddings
        self.vocab_size: int = config.vocab_size
        self.drafter: DraftProposer | None = None
        draft = self._load_draft(model_dir, draft_model) if draft_model is not None else None
        self.sampler = Sampler(seed=seed, device=self.device)
        # shapes only: the gateway checked the adapter's base model name when it registered it
        self.loras = ExecutorLoras(lora_options or LoraOptions(), replace(BaseShapes.of_config(config), names=frozenset()),
                                   self.dtype, self.device, self.tp, self.model.shard, head_dim_of(config))
        self.model_dir = model_dir
        self.grammar: GrammarMasks | None = None  # made on the first constrained request
        self._grammar_threads: ThreadPoolExecutor | None = None
        self.graphs: DecodeGraphs | CompiledDecode | None = None
        shape = (config.num_hidden_layers, block_size, self.model.num_local_kv_heads, head_dim_of(config))
        if num_kv_blocks is None:
            if kv_cache_memory is None and self.device.type == "cuda":
                kv_cache_memory = self._profile_kv_cache_memory(
                    shape, o.gpu_memory_utilization, o.limits.max_num_batched_tokens, max_num_seqs)
            memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
            if draft is not None:  # the draft's K/V of a block is paid from the same budget
                memory = memory * bytes_per_block(*shape, self.kv_dtype) // (
                    bytes_per_block(*shape, self.kv_dtype) + bytes_per_block(*self._draft_shape(draft), self.kv_dtype))
            num_kv_blocks = KVCache.blocks_for_memory(memory, *shape, self.kv_dtype)
        num_kv_blocks = self.tp.min_int(num_kv_blocks)  # every rank's pool has the same blocks
        compiled = o.compile_decode and self.device.type == "cpu" and self.tp.size == 1 and not o.deterministic
        if o.compile_decode and o.deterministic:
            log.info("--compile is off under --deterministic (each padded batch size would be its own graph)")
        elif o.compile_decode and not compiled:
            log.info("--compile is for decode steps on one CPU process; ignored here (CUDA graphs serve CUDA)")
        # a compiled decode step's padding rows write their K/V past the pool the scheduler knows
        extra = SCRATCH_BLOCKS if compiled else 0
        self.kv_cache = KVCache(shape[0], num_kv_blocks + extra, *shape[1:], self.kv_dtype, self.device)
        self.num_kv_blocks: int = num_kv_blocks
        per_block = bytes_per_block(*shape, self.kv_dtype)
        self.swap = HostKVCache(self.kv_cache, self.tp.min_int(o.swap_space // per_block) * per_block)
        if draft is not None:
            self.drafter = DraftProposer(draft, num_kv_blocks + extra, block_size, self.kv_dtype, self.device,
                                         self.swap.num_blocks)
            log.info("draft model %s: its KV pool %.1f MiB beside the target's, on the same blocks", draft_model,
                     self.drafter.kv.nbytes / 2**20)
        self.last_top_logprobs: list[list[tuple[int, float]]] = []
        self.pooler = Pooler()  # embedding requests' pooled states across their prompt's chunks
        self.last_pooled: Tensor | None = None
        if o.cuda_graphs and self.device.type == "cuda" and self.tp.size > 1:
            log.info("no CUDA graphs under tensor parallelism (the all-reduces are not captured)")
        elif o.cuda_graphs and self.device.type == "cuda" and self.backend.graph_safe:
            self.graphs = DecodeGraphs(self.model, self.kv_cache.k_caches, self.kv_cache.v_caches, block_size,
                                       self.max_model_len, max_num_seqs, self.device)
        if step_calibrated:  # under TP a rank cannot time a step alone: the loader timed matmuls instead
            for line in calibrate_runner(self):
                log.info(line)
        if compiled:  # after calibration: the compiled graphs specialise on the quantized copies' row limits
            self.graphs = CompiledDecode(self.model, self.kv_cache.k_caches, self.kv_cache.v_caches, block_size,
                                         self.max_model_len, max_num_seqs, scratch_block=num_kv_blocks)
        log.info("%s loaded (%s, %s, %s attention); KV pool %d blocks of %d tokens in %s, %.1f MiB%s",
                 model_dir, self.dtype, self.device, self.backend.name, num_kv_blocks, block_size,
                 self.kv_dtype, self.kv_cache.nbytes / 2**20,
                 f" (tensor-parallel rank {self.tp.rank} of {self.tp.size}: query heads "
                 f"{self.model.shard.q_heads}, KV heads {self.model.shard.kv_heads})" if self.tp.size > 1 else "")

    def _load_draft(self, model_dir: str | Path, draft_dir: str | Path):
        """The draft model, loaded as the target is (dtype, backend, quantization, --deterministic);
        ValueError when it cannot propose for this target."""
        o = self.options
        if self.tp.size > 1:
            raise ValueError("a draft model (--speculative draft) runs on one process: not under tensor parallelism")
        draft = load_model(draft_dir, self.dtype, self.device, self.backend, o.quantization,
                           ALL_ROWS if o.deterministic or o.int4_max_rows is None else o.int4_max_rows)
        problem = vocabulary_problem(model_dir, draft_dir, self.model.config, draft.config)
        if problem is None and draft.config.max_position_embeddings < self.max_model_len:
            problem = (f"the draft model's context ({draft.config.max_position_embeddings} tokens) is shorter than "
                       f"the target's ({self.max_model_len})")
        if problem is not None:
            raise ValueError(f"draft model {draft_dir} cannot propose for {model_dir}: {problem}")
        if o.deterministic:
            for line in make_batch_invariant(draft):
                log.info("draft model: %s", line)
        return draft

    @staticmethod
    def _draft_shape(draft) -> tuple[int, int, int, int]:
        return (draft.config.num_hidden_layers, 1, draft.num_local_kv_heads, head_dim_of(draft.config))

    def compute_logits(self, step: ExecuteStep, blocks_moved: bool = False) -> tuple[Tensor | None, BatchMetadata]:
        """Run the step's forward pass; float32 logits of its sampled sequences, in order
        (None on tensor-parallel ranks other than 0).

        A decode step replayed from a CUDA graph keeps its BatchMetadata on the CPU.
        Under tensor parallelism a forward pass that raises leaves the ranks out of step:
        `GroupBroken`, whatever the cause (InvalidStep, raised before, is the same on every rank).
        blocks_moved: the step's block moves are done already (`run`, with a draft model)."""
        graph = (self.graphs is not None and not step.pooling and not step.lora_slots and self.graphs.fits(step)
                 and not any(s.score_targets for s in step.seqs))
        meta = BatchMetadata.from_step(step, self.block_size, self.num_kv_blocks, "cpu" if graph else self.device)
        meta.lora = self.loras.prepare(step, meta.query_lens)
        if not blocks_moved:
            self._move_blocks(step)
        self.last_pooled = None
        start = time.perf_counter()
        with torch.inference_mode():
            if graph:
                logits = self.graphs.replay(meta)
            elif self.tp.size == 1:
                logits = self._forward(step, meta)
            else:
                try:
                    logits = self._forward(step, meta)
                except GroupBroken:
                    raise
                except Exception as exc:
                    raise GroupBroken(f"{type(exc).__name__}: {exc}", peer_lost=False) from exc
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run asynchronously: time them to the end
        self.last_forward_s = time.perf_counter() - start
        return logits, meta

    def _forward(self, step: ExecuteStep, meta: BatchMetadata) -> Tensor | None:
        """The model's logits; a step with embedding rows also leaves their rows' final hidden
        states in last_pooled, for `run` (and `compute_logits`' callers) to pool."""
        if not step.pooling:
            return self.model(meta, self.kv_cache.k_caches, self.kv_cache.v_caches)
        rows = torch.tensor(Pooler.rows(step, meta.query_lens), dtype=torch.long, device=self.device)
        logits, self.last_pooled = self.model.forward_pooled(meta, self.kv_cache.k_caches, self.kv_cache.v_caches,
                                                             rows)
        return logits

    def execute(self, step: ExecuteStep) -> list[int]:
        """The token sampled for each of step.seqs, or -1 where a sequence is not sampled
        (the rest of the result in last_top_logprobs and last_forward_s)."""
        result = self.run(step)
        self.last_top_logprobs = result.top_logprobs
        return result.sampled

    def run(self, step: ExecuteStep) -> StepResult:
        self.last_forward_s = 0.0
        if len(self.pooler) and (step.released or step.reset_states):
            self.pooler.release(step)
        if not step.seqs:
            self._move_blocks(step)
            return StepResult(step.step_id, [], 0.0)
        blocks_moved = self._propose(step)
        seqs = sampled_rows(step.seqs)  # one per sampled row: a speculating sequence has several
        if self.tp.rank > 0:
            seqs = []  # no sampling here: no grammar masks to fill
        # the grammar masks of constrained sequences are filled while the forward pass runs
        masks = (self._grammar_pool().submit(self._grammar().masks, seqs)
                 if any(s.sampling.structured is not None for s in seqs) else None)
        logits, meta = self.compute_logits(step, blocks_moved)
        result = StepResult(step.step_id, [-1] * len(step.seqs), self.last_forward_s)
        result.proposed = [s.draft_token_ids for s in step.seqs if s.num_proposals]
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return result
        failed: dict[int, tuple[int, str]] = {}  # sampled row -> (status, why)
        bitmask = None
        if masks is not None:
            try:
                bitmask, broken = masks.result()
                failed.update((j, (500, why)) for j, why in broken.items())
            except Exception as exc:  # no grammar at all here: only the constrained rows fail
                log.exception("grammar masks of step %d", step.step_id)
                failed.update((j, (500, f"grammar: {type(exc).__name__}: {exc}")) for j, s in enumerate(seqs)
                              if s.sampling.structured is not None)
        num_sampled = len(meta.sampled_seqs)
        if num_sampled:
            params = [s.sampling for s in seqs]
            indices = row_output_indices(step.seqs)
            histories = [History(s.prompt_token_ids, s.output_token_ids) if s.sampling.needs_output else None
                         for s in seqs]
            raw = logits[:num_sampled]
            processed = self._process(raw, params, indices, histories, failed)
            if bitmask is not None:
                processed = self.grammar.apply(processed, bitmask)
            tokens = self._sample(processed, params, indices, failed)
            if bitmask is not None:
                for j, why in self.grammar.accept(seqs, tokens).items():
                    failed[j], tokens[j] = (500, why), -1
            emitted = settle(step.seqs, meta.sampled_seqs, tokens, result, failed)
            result.top_logprobs = self._top_logprobs(processed, seqs)
            asked = [j for j in emitted if params[j].logprobs is not None]
            if asked:
                result.logprobs = self._logprobs(raw, asked, tokens, params, failed)
        failures = {meta.sampled_seqs[j]: why for j, why in failed.items()}  # by index in step.seqs
        if meta.lora is not None:
            failures.update((i, (400, why)) for i, why in meta.lora.failed.items())
        if step.pooling:
            result.embeddings, broken = self.pooler.pool(step, self.last_pooled)
            failures.update((i, (500, why)) for i, why in broken.items())
        row = num_sampled
        for i, m in meta.scored_seqs or []:
            seq = step.seqs[i]
            try:
                scored = token_logprobs(logits[row : row + m], list(seq.score_targets), [seq.prompt_logprobs] * m)
            except Exception as exc:
                scored = []  # a placeholder: the request ends with the error
                failures.setdefault(i, (500, f"prompt logprobs: {type(exc).__name__}: {exc}"))
            result.prompt_logprobs.append(scored)
            row += m
        result.failed = [FailedRow(i, status, why) for i, (status, why) in sorted(failures.items())]
        for f in result.failed:
            result.sampled[f.index] = -1
        return result

    def _propose(self, step: ExecuteStep) -> bool:
        """With a draft model: the step's block moves, then its proposals (`draft_model`); whether
        the blocks were moved."""
        if self.drafter is None:
            if any(s.num_proposals for s in step.seqs):
                raise InvalidStep("the step asks for a draft model's proposals, and this executor has none "
                                  "(--speculative draft --draft-model PATH)")
            return False
        self._move_blocks(step)
        self.drafter.observe(step)
        self.drafter.propose(step)
        return True

    def _process(self, raw: Tensor, params: list, indices: list[int], histories: list,
                 failed: dict[int, tuple[int, str]]) -> Tensor:
        """The processed logits; when the batch raises, row by row, failing the rows that raise
        (their logits all -inf, so nothing is sampled from them)."""
        try:
            return self.sampler.process(raw, params, indices, histories)
        except Exception:
            log.exception("logits processors of %d rows raised: redone row by row", len(params))
        rows = []
        for j in range(len(params)):
            try:
                rows.append(self.sampler.process(raw[j : j + 1], params[j : j + 1], indices[j : j + 1],
                                                 histories[j : j + 1]))
            except Exception as exc:
                failed.setdefault(j, (500, f"logits processors: {type(exc).__name__}: {exc}"))
                rows.append(torch.full_like(raw[j : j + 1], float("-inf")))
        return torch.cat(rows)

    def _sample(self, processed: Tensor, params: list, indices: list[int],
                failed: dict[int, tuple[int, str]]) -> list[int]:
        """A token per row, -1 for the failed ones; a row that allows no token fails (400: its
        own constraints exclude each other)."""
        try:
            tokens = self.sampler.sample(processed, params, indices, set(failed))
        except Exception:
            log.exception("sampling %d rows raised: redone row by row", len(params))
            tokens = [-1] * len(params)
            for j in range(len(params)):
                if j in failed:
                    continue
                try:
                    tokens[j] = self.sampler.sample(processed[j : j + 1], params[j : j + 1], indices[j : j + 1])[0]
                except Exception as exc:
                    failed[j] = (500, f"sampling: {type(exc).__name__}: {exc}")
        for j, token in enumerate(tokens):
            if token < 0 and j not in failed:
                failed[j] = (400, no_token_problem(params[j], indices[j]))
        return tokens

    @staticmethod
    def _logprobs(raw: Tensor, asked: list[int], tokens: list[int], params: list,
                  failed: dict[int, tuple[int, str]]) -> list[TokenLogprob]:
        """The sampled tokens' logprobs of the rows in asked; a failed row's is a placeholder
        (token -1), and a row whose logprobs raise fails."""
        out = {j: TokenLogprob(-1, 0.0) for j in asked if tokens[j] < 0}
        live = [j for j in asked if tokens[j] >= 0]
        try:
            out.update(zip(live, token_logprobs(raw[live], [tokens[j] for j in live],
                                                [params[j].logprobs for j in live]), strict=True))
        except Exception:
            for j in live:
                try:
                    out[j] = token_logprobs(raw[j : j + 1], [tokens[j]], [params[j].logprobs])[0]
                except Exception as exc:
                    failed[j], out[j] = (500, f"logprobs: {type(exc).__name__}: {exc}"), TokenLogprob(-1, 0.0)
        return [out[j] for j in asked]

    def _grammar(self) -> GrammarMasks:
        if self.grammar is None:
            self.grammar = GrammarMasks(self.model_dir, self.vocab_size)
        return self.grammar

    def _grammar_pool(self) -> ThreadPoolExecutor:
        if self._grammar_threads is None:
            self._grammar_threads = ThreadPoolExecutor(1, thread_name_prefix="grammar",
                                                     initializer=cpu_placement.join_shared_cores)
        return self._grammar_threads

    @staticmethod
    def _top_logprobs(logits: Tensor, seqs: list) -> list[list[tuple[int, float]]]:
        """Best (token, logprob) candidates of the sampled seqs that asked (beams), in order."""
        rows = [i for i, s in enumerate(seqs) if s.num_logprobs > 0]
        if not rows:
            return []
        k = max(seqs[i].num_logprobs for i in rows)
        values, tokens = torch.log_softmax(logits[rows].float(), dim=-1).topk(k, dim=-1)
        return [list(zip(tokens[j, : seqs[i].num_logprobs].tolist(), values[j, : seqs[i].num_logprobs].tolist(),
                         strict=True)) for j, i in enumerate(rows)]

    def _move_blocks(self, step: ExecuteStep) -> None:
        """Swap out, swap in, then copy-on-write copies, before the step's forward pass."""
        with torch.inference_mode():
            self.swap.swap_out(step.swap_out)
            self.swap.swap_in(step.swap_in)
        self._copy_blocks(step)
        if self.drafter is not None:
            self.drafter.move_blocks(step, self.backend.copy_blocks)

    def _copy_blocks(self, step: ExecuteStep) -> None:
        if not step.block_copies:
            return
        if any(not (0 <= b < self.num_kv_blocks) for pair in step.block_copies for b in pair):
            raise InvalidStep(f"block copy outside the pool of {self.num_kv_blocks} blocks")
        with torch.inference_mode():
            self.backend.copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches, step.block_copies)

    def _profile_kv_cache_memory(self, shape: tuple[int, int, int, int], utilization: float,
                                 max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Bytes left for the KV pool after one step of the largest batch (see `gpu_memory`)."""
        step, blocks = profile_step(max_num_batched_tokens, max_num_seqs, self.max_model_len, self.block_size,
                                    self.vocab_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.kv_cache = KVCache(shape[0], blocks, *shape[1:], self.kv_dtype, self.device)
        self.num_kv_blocks = blocks
        self.execute(step)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.nbytes
        del self.kv_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_cache_budget(total, free, torch.cuda.memory_reserved(self.device), peak, utilization)
        log.info("profiling step of %d tokens: peak %.2f GiB besides the pool; %.2f of %.2f GiB for the pool "
                 "at utilization %.2f", sum(len(s.token_ids) for s in step.seqs), peak / 2**30,
                 budget / 2**30, total / 2**30, utilization)
        if budget < bytes_per_block(*shape, self.kv_dtype):
            raise RuntimeError(f"no GPU memory left for the KV pool at --gpu-memory-utilization {utilization} "
                               f"(peak use besides the pool {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)")
        return budget
