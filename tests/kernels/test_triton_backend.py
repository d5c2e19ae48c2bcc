"""The Triton backend as the model uses it: backend choice, mixed steps, and a whole model run through it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.attention import get_backend  # noqa: E402
from kernels.triton_backend import TRITON, paged_attention  # noqa: E402
from services.executor.cuda_graphs import DecodeGraphs  # noqa: E402
from services.executor.model_runner import ModelRunner  # noqa: E402
from shared.messages import ExecuteStep  # noqa: E402
from tests.executor.test_model_runner import BLOCK, Driver, make_model, prompts  # noqa: E402
from tests.kernels.paged_batch import INTERPRETED, assert_close, build, reference, runnable  # noqa: E402

pytestmark = runnable


def test_backend_choice():
    assert get_backend("triton", "cuda") is TRITON
    assert get_backend("auto", "cuda") is TRITON
    assert get_backend("auto", "cpu").name in ("cpu", "torch")  # never the interpreter unless asked for
    if INTERPRETED:
        assert get_backend("triton", "cpu") is TRITON
    with pytest.raises(ValueError):
        get_backend("triton", "mps")


@pytest.mark.parametrize("seqs", [
    [(37, 1), (20, 20), (50, 13), (9, 1)],  # mixed: the prefill kernel takes every row
    [(37, 1), (16, 1), (1, 1)],  # decode only: the split-K kernel
], ids=["mixed", "decode"])
def test_paged_attention_dispatch(seqs):
    inputs = build(seqs, 6, 2, 64, 16, torch.bfloat16)
    assert_close(paged_attention(**inputs), reference(inputs))


@pytest.mark.skipif(not INTERPRETED, reason="runs the model on the CPU, under the interpreter")
@pytest.mark.parametrize("variant", ["untied", "mistral_sliding_window"])
def test_model_runner_on_triton_matches_torch(variant, tmp_path):
    """Chunked prefill, then decode steps: the same greedy tokens and near-equal logits either way."""
    make_model(tmp_path, variant)
    a, b = prompts(3, [21, 9])
    results = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(tmp_path, dtype="float32", block_size=BLOCK, num_kv_blocks=16, attention_backend=backend)
        assert runner.backend.name == backend
        drv = Driver(runner, seed=1)
        drv.add("a", a)
        drv.add("b", b)
        first, _ = runner.compute_logits(ExecuteStep(1, [drv.chunk("a", 13, sample=False), drv.chunk("b")]))
        second, _ = runner.compute_logits(ExecuteStep(2, [drv.chunk("a")]))
        drv.seqs["a"]["tokens"].append(int(second[0].argmax()))
        drv.seqs["b"]["tokens"].append(int(first[0].argmax()))
        drv.decode_all(4)
        results[backend] = (torch.cat([first, second]), drv.seqs["a"]["out"], drv.seqs["b"]["out"])
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-4, rtol=1e-4)
    assert results["triton"][1:] == results["torch"][1:]


class EagerDecodeGraphs(DecodeGraphs):
    """DecodeGraphs' static buffers and padding, each replay a plain forward pass (no CUDA here)."""

    def capture(self) -> None:
        pass

    def _launch(self, size: int) -> None:
        self.logits[size] = self.model(self._meta(size), self.k_caches, self.v_caches)


@pytest.mark.skipif(not INTERPRETED, reason="runs the model on the CPU, under the interpreter")
def test_decode_graph_inputs_and_padding(tmp_path):
    """Decode batches of 5, 3, 1 and 2 through the graphs' static buffers (sizes 5, 4, 1, 2): the same
    tokens as eager steps, and a padding row (left over from a bigger batch) writes no KV."""
    make_model(tmp_path, "untied")
    outs = {}
    for graphs in (False, True):
        runner = ModelRunner(tmp_path, dtype="float32", block_size=BLOCK, num_kv_blocks=32,
                             attention_backend="triton")
        drv = Driver(runner, seed=4)
        for rid, prompt in zip("abcde", prompts(5, [20, 9, 3, 12, 7]), strict=True):
            drv.add(rid, prompt)
        drv.run([drv.chunk(rid) for rid in "abcde"])
        if graphs:
            runner.graphs = EagerDecodeGraphs(runner.model, runner.kv_cache.k_caches, runner.kv_cache.v_caches,
                                              BLOCK, runner.max_model_len, 5, runner.device)
        drv.run([drv.chunk(rid) for rid in "abcde"])
        d = drv.seqs["d"]
        pos = d["computed"] - 1
        d_slot = d["table"][pos // BLOCK] * BLOCK + pos % BLOCK
        k_slots = [cache.view(-1, *cache.shape[2:])[d_slot] for cache in runner.kv_cache.k_caches]
        for k in k_slots:
            k.zero_()  # d stops here; row 3 of the next batch still holds d's inputs
        drv.run([drv.chunk(rid) for rid in "abc"])
        assert not any(k.any() for k in k_slots)
        for _ in range(2):
            drv.run([drv.chunk("b")])
        drv.run([drv.chunk("c"), drv.chunk("a", sample=False)])
        outs[graphs] = [drv.seqs[rid]["out"] for rid in "abcde"]
        if graphs:
            assert sorted(runner.graphs.logits) == [1, 2, 4, 5]
    assert outs[True] == outs[False]


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a GPU and compiled kernels")
def test_cuda_runner_matches_cpu(tmp_path):
    """On the GPU, eager and with the pool sized by profiling and decode replayed from CUDA graphs
    (three sequences: a captured size of 4 with one padding row), the CPU path's tokens and logits."""
    make_model(tmp_path, "untied")
    runners = {
        "cpu": dict(device="cpu", num_kv_blocks=64),
        "cuda eager": dict(device="cuda", num_kv_blocks=64, cuda_graphs=False),
        "cuda graphs": dict(device="cuda", gpu_memory_utilization=0.05, max_num_seqs=8, max_num_batched_tokens=64),
    }
    results = {}
    for name, kwargs in runners.items():
        runner = ModelRunner(tmp_path, dtype="float32", block_size=BLOCK, **kwargs)
        if name == "cuda graphs":
            assert runner.graphs is not None and runner.backend.name == "triton"
            assert runner.num_kv_blocks > 1000  # sized from the GPU's memory, not the 1 GiB default
        drv = Driver(runner, seed=2)
        for rid, prompt in zip("abc", prompts(4, [21, 9, 30]), strict=True):
            drv.add(rid, prompt)
        drv.decode_all(6)
        logits, _ = runner.compute_logits(ExecuteStep(99, [drv.chunk(rid) for rid in "abc"]))
        results[name] = ([drv.seqs[rid]["out"] for rid in "abc"], logits.cpu())
        del runner, drv
        torch.cuda.empty_cache()
    for name in ("cuda eager", "cuda graphs"):
        assert results[name][0] == results["cpu"][0], name
        torch.testing.assert_close(results[name][1], results["cpu"][1], atol=1e-3, rtol=1e-3)
