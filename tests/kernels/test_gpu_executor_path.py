"""The executor's CUDA path, the parts a CPU can check: options, the profiling step, the pool budget."""

from __future__ import annotations

import pytest
import torch

from services.executor.batch import BatchMetadata
from services.executor.cuda_graphs import capture_sizes
from services.executor.gpu_memory import kv_cache_budget, profile_step
from services.executor.model_runner import ModelRunner
from tests.executor.test_model_runner import make_model
from tests.helpers import executor_args_from_launcher

GiB = 1 << 30


def test_launcher_passes_gpu_options_to_the_executor():
    args = executor_args_from_launcher(["--device", "cuda", "--gpu-memory-utilization", "0.8",
                                        "--attention-backend", "triton", "--no-cuda-graphs",
                                        "--max-num-seqs", "64", "--max-num-batched-tokens", "4096"])
    assert (args.device, args.gpu_memory_utilization, args.attention_backend) == ("cuda", 0.8, "triton")
    assert (args.cuda_graphs, args.max_num_seqs, args.max_num_batched_tokens) == (False, 64, 4096)
    defaults = executor_args_from_launcher([])
    assert (defaults.device, defaults.gpu_memory_utilization, defaults.attention_backend) == ("cpu", 0.9, "auto")
    assert defaults.cuda_graphs and (defaults.max_num_seqs, defaults.max_num_batched_tokens) == (256, 2048)


def test_profile_step_spreads_the_largest_batch():
    step, blocks = profile_step(max_num_batched_tokens=100, max_num_seqs=8, max_model_len=256, block_size=8,
                                vocab_size=1000)
    lens = [len(s.token_ids) for s in step.seqs]
    assert len(lens) == 8 and sum(lens) == 100 and max(lens) - min(lens) <= 1
    assert all(s.sample and s.start_pos == 0 for s in step.seqs)
    assert blocks == sum(-(-n // 8) for n in lens)
    BatchMetadata.from_step(step, 8, blocks)  # a valid step: tables and slots agree, all within the pool
    # fewer tokens than sequences allowed, and prompts capped at the model's length
    assert len(profile_step(5, 256, 256, 8, 1000)[0].seqs) == 5
    capped, _ = profile_step(4096, 2, 100, 16, 1000)
    assert [len(s.token_ids) for s in capped.seqs] == [100, 100]


def test_profile_step_runs_through_the_runner(tmp_path):
    make_model(tmp_path, "untied")
    step, blocks = profile_step(64, 6, 256, 8, 1000)
    runner = ModelRunner(tmp_path, dtype="float32", block_size=8, num_kv_blocks=blocks)
    sampled = runner.execute(step)
    assert len(sampled) == 6 and all(0 <= t < 1000 for t in sampled)


def test_profiling_pass_feeds_the_budget(tmp_path, monkeypatch):
    """The profiling pass on the CPU, torch.cuda's memory figures faked: it runs the largest step on a
    temporary pool, leaves that pool's bytes out of the peak, and drops the pool afterwards."""
    make_model(tmp_path, "untied")
    runner = ModelRunner(tmp_path, dtype="float32", block_size=8, num_kv_blocks=4)
    temp_pool_bytes = []

    def peak(_device):
        temp_pool_bytes.append(runner.kv_cache.nbytes)
        return runner.kv_cache.nbytes + 5 * GiB

    for name, fake in {"empty_cache": lambda: None, "reset_peak_memory_stats": lambda _d: None,
                       "synchronize": lambda _d=None: None, "max_memory_allocated": peak,
                       "mem_get_info": lambda _d: (60 * GiB, 100 * GiB),
                       "memory_reserved": lambda _d: 10 * GiB}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    shape = (2, 8, 2, 16)  # layers, block size, KV heads, head dim of the tiny model
    budget = runner._profile_kv_cache_memory(shape, 0.9, max_num_batched_tokens=64, max_num_seqs=6)
    assert budget == kv_cache_budget(100 * GiB, 60 * GiB, 10 * GiB, 5 * GiB, 0.9)
    _, blocks = profile_step(64, 6, runner.max_model_len, 8, runner.vocab_size)
    assert temp_pool_bytes == [blocks * 2 * 2 * 8 * 2 * 16 * 4]
    assert runner.last_forward_s > 0 and not hasattr(runner, "kv_cache")


def test_kv_cache_budget():
    # 30 GiB outside torch's allocator (CUDA context, other processes), a 12 GiB peak besides the pool
    assert kv_cache_budget(total=100 * GiB, free=60 * GiB, reserved=10 * GiB, peak_allocated=12 * GiB,
                           utilization=0.9) == 48 * GiB
    assert kv_cache_budget(100 * GiB, 60 * GiB, 10 * GiB, 12 * GiB, 0.5) == 8 * GiB
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError):
            kv_cache_budget(100 * GiB, 60 * GiB, 10 * GiB, 12 * GiB, bad)


def test_capture_sizes():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256
