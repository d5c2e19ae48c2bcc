"""The executor's options: its model runner's (`ExecutorOptions`, which `ModelRunner` takes
whole) and its tensor-parallel group's (`ParallelOptions`). Free of torch, so that the
launcher builds `serve`'s flags from them without loading it (see shared.options)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from shared.config import BatchLimits
from shared.options import group, option, parse_size

DTYPES = ("auto", "bfloat16", "float16", "float32")
INSECURE_ENV = "PAGEDSERVE_ALLOW_INSECURE_TP_RENDEZVOUS"


@dataclass(frozen=True)
class ExecutorOptions:
    """executor (weights, KV pool, forward passes)"""

    dtype: str = option("auto", "auto: bfloat16 on CUDA and on CPUs with bfloat16 matrix instructions, else "
                                "float32", choices=DTYPES)
    quantization: str = option("auto", "int4: also keep 4-bit copies of the decoder's weights (groups of 32, as "
                                       "GGUF Q4_1) for steps of few tokens, where reading weights dominates; auto: "
                                       "int4 when the checkpoint is already 4-bit (lossless), else none",
                               choices=("auto", "int4", "none"))
    int4_max_rows: int | None = option(None, "steps of at most this many tokens use the int4 copies (default: "
                                             "measured at load)", parse=int)
    prepack: str = option("auto", "auto: on the CPU, also keep the dense bfloat16/float16 weights prepacked for "
                                  "steps of up to 512 rows (the weights' bytes once more; services.executor.prepack): "
                                  "in the AMX tiles' layout where the CPU has AMX, else oneDNN's blocked layout; "
                                  "tiles / onednn: that layout only; none: F.linear only",
                          choices=("auto", "tiles", "onednn", "none"))
    kv_cache_dtype: str = option("auto", "auto: the compute dtype; bfloat16 with float32 compute halves the pool's "
                                         "bytes per block (CPU backends only)", choices=DTYPES)
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "pool size; wins over --kv-cache-memory", parse=int)
    kv_cache_memory: int | None = option(None, "bytes for the KV pool (e.g. 1073741824 or 2GiB); default 1 GiB on "
                                               "the CPU, profiled on CUDA", parse=parse_size)
    swap_space: int = option(0, "bytes of host memory for the KV of swapped-out sequences (e.g. 4GiB; "
                                "--preemption-mode swap)", parse=parse_size)
    device: str = option("cpu", "cpu, cuda or cuda:K (with several engines or ranks, the first of their GPUs)")
    attention_backend: str = option("auto", "auto: Triton kernels on CUDA, the C++ CPU kernels on the CPU (the "
                                            "torch reference if they cannot be built)",
                                    choices=("auto", "cpu", "triton", "torch"))
    gpu_memory_utilization: float = option(0.9, "on CUDA, the fraction of GPU memory the executor may use; the KV "
                                                "pool gets what a profiling pass of the largest batch leaves "
                                                "(unless sized explicitly)")
    limits: BatchLimits = group(BatchLimits)
    cuda_graphs: bool = option(True, "run decode steps eagerly instead of replaying CUDA graphs")
    compile_decode: bool = option(False, "on the CPU, run decode steps through torch.compile (inductor), one graph "
                                         "per bucketed batch size compiled on its first step and cached on disk "
                                         "(services.executor.compiled_decode); prefill stays eager",
                                  flag="--compile")
    threads: int | None = option(None, "torch intra-op threads in the executor", parse=int,
                                 serve_flag="--executor-threads")
    keep_main_core: bool = option(False, "on the CPU, once loaded: the main thread keeps the first allowed core to "
                                         "itself, the other threads (OpenMP workers, sockets) run on the rest "
                                         "(shared.cpu_placement; `serve` passes it when one executor has the host's "
                                         "CPU)", stage_only=True)
    executor_id: str | None = option(None, "name in heartbeats and ExecutorReady", stage_only=True)
    deterministic: bool = option(False, "batch-invariant steps: a request's tokens and logprobs are the same alone, "
                                        "in any batch, however its prompt is chunked and after a replay (one kernel "
                                        "path per linear for every row count, dense matmuls in fixed tiles of rows, "
                                        "no --compile; services.executor.deterministic). Same machine and thread "
                                        "count only")


@dataclass(frozen=True)
class ParallelOptions:
    """tensor parallelism"""

    tensor_parallel_size: int = option(1, "processes each executor's model is split over (torch.distributed: gloo "
                                          "on the CPU, NCCL on CUDA, one GPU per rank); a stage is one of them, "
                                          "started with --tp-rank")
    tp_rank: int = option(0, "this process's rank in the tensor-parallel group", stage_only=True)
    tp_init_address: str | None = option(
        help="tcp://host:port where the ranks meet (rank 0 listens there; default $PAGEDSERVE_TP_INIT_ADDRESS); "
             "loopback only unless --allow-insecure-tp-rendezvous", stage_only=True,
        default_factory=lambda: os.environ.get("PAGEDSERVE_TP_INIT_ADDRESS"))
    allow_insecure_tp_rendezvous: bool = option(
        False, "let the ranks meet on a non-loopback address: torch.distributed and gloo are unauthenticated "
               f"plaintext (or ${INSECURE_ENV}=1); only on a network no one else reaches (`serve`'s own ranks "
               "meet on 127.0.0.1)")
