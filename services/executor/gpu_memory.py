"""Sizing the KV pool on a GPU from what a profiling pass of the largest step leaves free.

The pool gets `utilization` of the GPU's total memory less everything else at the
executor's peak: the weights, the activations of the largest step the scheduler may
send (max_num_batched_tokens tokens over up to max_num_seqs sequences, every one
sampled through the sampler's heaviest path), and what lies outside torch's
allocator (the CUDA context, library workspaces, other processes on the GPU). The
rest of the GPU stays free for CUDA graphs and allocator slack.
"""

from __future__ import annotations

from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling

# top-k and top-p both set: the sampler sorts the whole vocabulary, its costliest path
PROFILE_SAMPLING = SeqSampling(temperature=1.0, top_p=0.9, top_k=50, seed=None)


def profile_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 vocab_size: int) -> tuple[ExecuteStep, int]:
    """The largest step as whole prompts on blocks 0, 1, 2...; returns it and the blocks it uses."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    num_tokens = min(max_num_batched_tokens, num_seqs * max_model_len)
    seqs, next_block = [], 0
    for i in range(num_seqs):
        n = num_tokens // num_seqs + (i < num_tokens % num_seqs)
        table = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(table)
        seqs.append(ScheduledSeq(
            request_id=f"profile-{i}", token_ids=[(i + p) % vocab_size for p in range(n)], start_pos=0,
            block_table=table, slot_mapping=[table[p // block_size] * block_size + p % block_size for p in range(n)],
            sample=True, output_index=0, sampling=PROFILE_SAMPLING,
        ))
    return ExecuteStep(step_id=-1, seqs=seqs), next_block


def kv_cache_budget(total: int, free: int, reserved: int, peak_allocated: int, utilization: float) -> int:
    """Bytes for the pool. total/free: the GPU's (cudaMemGetInfo), read with the allocator's cache
    emptied; reserved: what torch's allocator holds then; peak_allocated: torch's peak during the
    profiling pass, without the pass's own small KV pool."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    outside_torch = total - free - reserved
    return int(total * utilization) - peak_allocated - outside_torch
