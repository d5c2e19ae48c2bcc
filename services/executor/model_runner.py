"""ModelRunner: owns the model, the KV pool and the sampler, and executes one step at a time.

A step is: copy-on-write block copies, then one forward pass over every scheduled
sequence's new tokens (their K/V land in the pool at the slots the scheduler chose),
then sampling of the sequences that asked for a token.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import Tensor

from kernels.attention import get_backend
from services.executor.batch import BatchMetadata, InvalidStep
from services.executor.kv_cache import DEFAULT_KV_CACHE_MEMORY, KVCache
from services.executor.loader import load_model, parse_dtype
from services.executor.models.llama import head_dim_of, num_kv_heads_of
from services.executor.sampler import Sampler
from shared.messages import ExecuteStep

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: str | torch.dtype = "bfloat16",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        device: str = "cpu",
        attention_backend: str = "auto",
        seed: int | None = None,
    ):
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.block_size = block_size
        self.backend = get_backend(attention_backend, device)
        self.model = load_model(model_dir, self.dtype, self.device, self.backend)
        config = self.model.config
        self.max_model_len: int = config.max_position_embeddings
        self.vocab_size: int = config.vocab_size
        shape = (config.num_hidden_layers, block_size, num_kv_heads_of(config), head_dim_of(config))
        if num_kv_blocks is None:
            memory = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
            num_kv_blocks = KVCache.blocks_for_memory(memory, *shape, self.dtype)
        self.kv_cache = KVCache(shape[0], num_kv_blocks, *shape[1:], self.dtype, self.device)
        self.num_kv_blocks: int = num_kv_blocks
        self.sampler = Sampler(seed=seed, device=self.device)
        log.info("%s loaded (%s, %s, %s attention); KV pool %d blocks of %d tokens, %.1f MiB",
                 model_dir, self.dtype, self.device, self.backend.name, num_kv_blocks, block_size,
                 self.kv_cache.nbytes / 2**20)

    def compute_logits(self, step: ExecuteStep) -> tuple[Tensor, BatchMetadata]:
        """Run the step's forward pass; float32 logits of its sampled sequences, in order."""
        meta = BatchMetadata.from_step(step, self.block_size, self.num_kv_blocks, self.device)
        self._copy_blocks(step)
        start = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(meta, self.kv_cache.k_caches, self.kv_cache.v_caches)
        self.last_forward_s = time.perf_counter() - start
        return logits, meta

    def execute(self, step: ExecuteStep) -> list[int]:
        """The token sampled for each of step.seqs, or -1 where a sequence is not sampled."""
        self.last_forward_s = 0.0
        if not step.seqs:
            self._copy_blocks(step)
            return []
        logits, meta = self.compute_logits(step)
        sampled = [-1] * len(step.seqs)
        if meta.sampled_seqs:
            seqs = [step.seqs[i] for i in meta.sampled_seqs]
            tokens = self.sampler(logits, [s.sampling for s in seqs], [s.output_index for s in seqs])
            for i, token in zip(meta.sampled_seqs, tokens, strict=True):
                sampled[i] = token
        return sampled

    def _copy_blocks(self, step: ExecuteStep) -> None:
        if not step.block_copies:
            return
        if any(not (0 <= b < self.num_kv_blocks) for pair in step.block_copies for b in pair):
            raise InvalidStep(f"block copy outside the pool of {self.num_kv_blocks} blocks")
        with torch.inference_mode():
            self.backend.copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches, step.block_copies)
