"""torch.compile'd decode steps (`--compile`, services.executor.compiled_decode) against eager ones.

Two runners over the same tiny random Llama in float32, one eager and one compiled, get
the same steps: a prefill (eager in both), then decode steps of 3 sequences (padded to
the bucket of 4) and of 1. The compiled logits must equal the eager ones within 1e-5,
with the C++ CPU kernels and with the torch reference, the padding rows must leave every
block of the scheduler's pool as the eager runner leaves it, and dynamo must trace the
whole forward pass as one graph (the kernels are custom ops, not graph breaks).
Each backend compiles two buckets (~10-20 s each on a loaded 2-core machine, less once
inductor's cache holds them). The custom ops' fake implementations are checked by
`torch.library.opcheck` against the real kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from kernels.cpu.build import load
from services.executor.compiled_decode import CompiledDecode
from services.executor.model_runner import ModelRunner
from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling
from tests.helpers import executor_args_from_launcher

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)
BLOCK = 8
NUM_BLOCKS = 24
TABLES = [[3, 1, 7], [2, 5], [9, 4, 8]]  # scattered; block 0 (the pool's first) is used too below
PROMPTS = [7, 5, 15]  # the first sequence crosses a block boundary at its first decode step

needs_cpu_kernels = pytest.mark.skipif(load() is None, reason="the C++ CPU kernels did not build")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-compile")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    hf = LlamaForCausalLM(config)
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(0, 1.0)
    hf.save_pretrained(path)
    return path


def seq(i: int, tokens: list[int], start: int, table: list[int]) -> ScheduledSeq:
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(tokens))]
    return ScheduledSeq(request_id=f"r{i}", token_ids=tokens, start_pos=start, block_table=table,
                        slot_mapping=slots, sample=True, output_index=0, sampling=GREEDY)


@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_cpu_kernels), "torch"])
def test_compiled_decode_logits_equal_eager(model_dir, backend):
    kwargs = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, attention_backend=backend,
                  max_num_seqs=8, quantization="none")
    eager = ModelRunner(model_dir, **kwargs)
    compiled = ModelRunner(model_dir, **kwargs, compile_decode=True)
    graphs = compiled.graphs
    assert isinstance(graphs, CompiledDecode) and graphs.sizes == [1, 2, 4, 8]
    assert compiled.num_kv_blocks == NUM_BLOCKS and compiled.kv_cache.k_caches[0].shape[0] == NUM_BLOCKS + 1

    tables = [list(t) for t in TABLES]
    tables[1][0] = 0  # a real sequence in block 0: padding rows must not write there
    prompts = [[(11 * i + j) % 1000 for j in range(n)] for i, n in enumerate(PROMPTS)]
    prefill = ExecuteStep(step_id=0, seqs=[seq(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    want, _ = eager.compute_logits(prefill)
    got, _ = compiled.compute_logits(prefill)
    assert not graphs.compiled  # prefill runs eagerly
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    counters.clear()
    lens = list(PROMPTS)
    tokens = want.argmax(-1).tolist()
    # decode steps of 3 sequences (bucket 4, one padding row), then of 1 (bucket 1)
    for step_id, live in [(1, [0, 1, 2]), (2, [0, 1, 2]), (3, [0, 1, 2]), (4, [2])]:
        step = ExecuteStep(step_id=step_id, seqs=[seq(i, [tokens[i]], lens[i], tables[i]) for i in live])
        want, _ = eager.compute_logits(step)
        got, _ = compiled.compute_logits(step)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, s=step_id: f"step {s}: {m}")
        for j, i in enumerate(live):
            tokens[i] = int(want[j].argmax())
            lens[i] += 1
    assert sorted(graphs.compiled) == [1, 4]  # compiled once per bucket, replayed after
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2
    for k_want, k_got, v_want, v_got in zip(eager.kv_cache.k_caches, compiled.kv_cache.k_caches,
                                            eager.kv_cache.v_caches, compiled.kv_cache.v_caches, strict=True):
        torch.testing.assert_close(k_got[:NUM_BLOCKS], k_want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_got[:NUM_BLOCKS], v_want, atol=1e-5, rtol=1e-5)


def test_runner_without_compile_has_no_scratch_block(model_dir):
    runner = ModelRunner(model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                         attention_backend="torch", quantization="none")
    assert runner.graphs is None and runner.kv_cache.k_caches[0].shape[0] == NUM_BLOCKS


@needs_cpu_kernels
def test_cpu_kernel_ops_fake_implementations():
    """The dispatcher ops' schemas and fake implementations agree with the real kernels."""
    from kernels.cpu.backend import backend

    backend()  # registers the fakes
    torch.manual_seed(0)
    heads, kv_heads, d, tokens = 4, 2, 16, 3
    k_cache, v_cache = torch.randn(6, BLOCK, kv_heads, d), torch.randn(6, BLOCK, kv_heads, d)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d)
    x, w = torch.randn(tokens, 64), torch.randn(64)
    ops = torch.ops.pagedserve
    cases = [
        (ops.paged_attention, (torch.empty(tokens, heads, d), torch.randn(tokens, heads, d), k_cache, v_cache,
                               torch.tensor([[1, 2], [3, 0], [4, 5]]), torch.arange(tokens + 1),
                               torch.tensor([9, 3, 16]), 0.25, 0)),
        (ops.rms_norm, (torch.empty_like(x), x, w, 1e-6)),
        (ops.fused_add_rms_norm, (x.clone(), torch.randn_like(x), w, 1e-6)),
        (ops.silu_and_mul, (torch.empty(tokens, 32), x)),
        (ops.rope_and_cache, (qkv, torch.tensor([0, 5, 9]), torch.randn(32, d), k_cache, v_cache,
                              torch.tensor([8, 29, 40]), heads, kv_heads)),
        (ops.int8_group_linear, (torch.empty(tokens, 48), x, torch.randint(-127, 128, (48, 64), dtype=torch.int8),
                                 torch.rand(48, 2))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_the_launcher_passes_compile_to_the_executor_and_it_stays_off_by_default():
    assert executor_args_from_launcher(["--compile"]).compile_decode
    assert not executor_args_from_launcher([]).compile_decode
