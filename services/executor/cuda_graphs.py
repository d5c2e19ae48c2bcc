"""CUDA graphs of the decode forward pass, one per common batch size.

A decode step of n sequences replays the graph of the smallest captured size >= n:
its inputs go into static buffers, and the rows past n are padding that writes no KV
(slot -1), attends over one token of block 0 and is never read. A captured forward
pass must take every size from tensor shapes, never from values on the device: the
Triton backend does, the torch reference does not, so graphs go with Triton only.
The static block table is as wide as the longest context allowed, which fixes the
decode kernel's partition count per graph.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from services.executor.batch import BatchMetadata
from shared.messages import ExecuteStep

log = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_batch: int) -> list[int]:
    """The common sizes up to max_batch, and max_batch itself; larger decode batches run eagerly."""
    top = max(1, min(max_batch, CAPTURE_SIZES[-1]))
    return [s for s in CAPTURE_SIZES if s < top] + [top]


class DecodeGraphs:
    def __init__(self, model: nn.Module, k_caches: list[Tensor], v_caches: list[Tensor], block_size: int,
                 max_model_len: int, max_batch: int, device: torch.device):
        self.sizes = capture_sizes(max_batch)
        self.block_size = block_size
        n = self.sizes[-1]
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
            self.positions = torch.zeros(n, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
            self.context_lens = torch.ones(n, dtype=torch.long, device=device)
            self.block_tables = torch.zeros(n, -(-max_model_len // block_size), dtype=torch.long, device=device)
            self.rows = torch.arange(n + 1, device=device)
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}
        self.capture()

    def capture(self) -> None:
        pool = None
        device = self.input_ids.device
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            meta = self._meta(size)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.inference_mode():
                self.model(meta, self.k_caches, self.v_caches)  # warm-up: compiles kernels, sets up cuBLAS
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.model(meta, self.k_caches, self.v_caches)
            pool = graph.pool()
            self.graphs[size] = graph
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _launch(self, size: int) -> None:
        """Fills self.logits[size] from the static inputs."""
        self.graphs[size].replay()

    def _meta(self, size: int) -> BatchMetadata:
        return BatchMetadata(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.rows[: size + 1], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], sample_indices=self.rows[:size], sampled_seqs=list(range(size)),
            query_lens=[1] * size, decode_seqs=list(range(size)), block_size=self.block_size,
        )

    def fits(self, step: ExecuteStep) -> bool:
        return (0 < len(step.seqs) <= self.sizes[-1]
                and all(len(s.token_ids) == 1 for s in step.seqs)
                and max(len(s.block_table) for s in step.seqs) <= self.block_tables.shape[1])

    def replay(self, meta: BatchMetadata) -> Tensor:
        """Float32 logits of meta's sampled sequences; meta is a decode batch that `fits`, on any device."""
        n = meta.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        with torch.inference_mode():
            self.input_ids[:n].copy_(meta.input_ids)
            self.positions[:n].copy_(meta.positions)
            self.slot_mapping[:n].copy_(meta.slot_mapping)
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[:n].copy_(meta.context_lens)
            self.context_lens[n:size].fill_(1)
            # entries past a row's width are stale but valid block ids, beyond its context: never read
            self.block_tables[:n, :width].copy_(meta.block_tables)
            self._launch(size)
            return self.logits[size][meta.sampled_seqs]
