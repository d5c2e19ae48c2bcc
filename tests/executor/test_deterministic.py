"""`--deterministic` (services.executor.deterministic): a greedy request's tokens and logprobs are bitwise
the same alone and inside steps of 3, 17 and 64 rows, its prompt chunked otherwise and mixed with other
requests' prefill chunks; and the per-op facts the mode rests on.

Without the flag the same runs are printed side by side (where they differ), never asserted: whether
they differ is up to the machine's kernels.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from services.executor.deterministic import TILE_ROWS, tiled_linear
from services.executor.model_runner import ModelRunner
from services.executor.quantization import ALL_ROWS, Q4Weight, Q8Weight
from services.executor.sampler import greedy_tokens
from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling
from tests.helpers import make_tiny_llama

ASK = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=5)
VOCAB = 49152
NEW_TOKENS = 6
TARGET = "target"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


class Requests:
    """The scheduler's part by hand: each request's blocks, tokens and outputs; steps of chosen chunks."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.block = runner, runner.block_size
        self.free = list(range(1, runner.num_kv_blocks))
        random.Random(0).shuffle(self.free)
        self.seqs: dict[str, dict] = {}
        self.step_id = 0

    def add(self, rid: str, prompt: list[int]) -> None:
        self.seqs[rid] = dict(tokens=list(prompt), table=[], done=0, prompt=len(prompt), out=[], logprobs=[])

    def chunk(self, rid: str, n: int | None = None) -> ScheduledSeq:
        s = self.seqs[rid]
        n = len(s["tokens"]) - s["done"] if n is None else n
        start = s["done"]
        while len(s["table"]) * self.block < start + n:
            s["table"].append(self.free.pop())
        s["done"] += n
        return ScheduledSeq(request_id=rid, token_ids=s["tokens"][start : start + n], start_pos=start,
                            block_table=list(s["table"]), slot_mapping=[s["table"][p // self.block] * self.block
                                                                        + p % self.block for p in range(start, start + n)],
                            sample=s["done"] == len(s["tokens"]), output_index=len(s["out"]), sampling=ASK)

    def step(self, chunks: list[ScheduledSeq]) -> None:
        self.step_id += 1
        result = self.runner.run(ExecuteStep(self.step_id, chunks))
        logprobs = iter(result.logprobs)
        for seq, token in zip(chunks, result.sampled, strict=True):
            if seq.sample:
                s = self.seqs[seq.request_id]
                s["out"].append(token)
                s["tokens"].append(token)
                lp = next(logprobs)
                s["logprobs"].append((lp.token, lp.logprob, lp.rank, [(t.token, t.logprob) for t in lp.top]))

    def pending(self, rid: str) -> bool:
        s = self.seqs[rid]
        return len(s["out"]) < NEW_TOKENS


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def alone(runner: ModelRunner, target: list[int]) -> tuple[list[int], list]:
    reqs = Requests(runner)
    reqs.add(TARGET, target)
    while reqs.pending(TARGET):
        reqs.step([reqs.chunk(TARGET)])
    s = reqs.seqs[TARGET]
    return s["out"], s["logprobs"]


def in_company(runner: ModelRunner, target: list[int], rows: int, seed: int) -> tuple[list[int], list]:
    """The target among rows - 1 other requests: its prompt in chunks of 13 tokens beside other
    prompts' chunks, then decode steps of `rows` rows, and every other step a newcomer's prefill chunk."""
    rng = random.Random(seed)
    reqs = Requests(runner)
    reqs.add(TARGET, target)
    others = [f"r{i}" for i in range(rows - 1)]
    for rid in others:
        reqs.add(rid, prompt(rng, rng.randrange(5, 40)))
    while reqs.seqs[TARGET]["done"] < len(target):  # the target's prompt with everyone else's, chunked
        left = len(target) - reqs.seqs[TARGET]["done"]
        step = [reqs.chunk(TARGET, min(13, left))]
        waiting = [rid for rid in others if reqs.seqs[rid]["done"] < len(reqs.seqs[rid]["tokens"])]
        step += [reqs.chunk(rid) for rid in waiting[:20]]
        reqs.step(step)
    for rid in others:  # everyone's prompt done before the decode steps
        if reqs.seqs[rid]["done"] < len(reqs.seqs[rid]["tokens"]):
            reqs.step([reqs.chunk(rid)])
    newcomer = 0
    while reqs.pending(TARGET):
        step = [reqs.chunk(rid) for rid in [TARGET, *others]]
        if reqs.step_id % 2:
            newcomer += 1
            reqs.add(f"new{newcomer}", prompt(rng, 21))
            step.insert(rng.randrange(len(step) + 1), reqs.chunk(f"new{newcomer}", 11))
        reqs.step(step)
    s = reqs.seqs[TARGET]
    return s["out"], s["logprobs"]


CASES = [("none", "float32"), ("none", "bfloat16"), ("int4", "float32")]


@pytest.mark.parametrize("quantization,dtype", CASES)
def test_a_greedy_request_is_bitwise_the_same_alone_and_in_any_batch(tiny, quantization, dtype):
    runner = ModelRunner(tiny, dtype=dtype, quantization=quantization, num_kv_blocks=1200, deterministic=True)
    target = prompt(random.Random(7), 37)
    tokens, logprobs = alone(runner, target)
    for rows in (1, 3, 17, 64):
        assert in_company(runner, target, rows, seed=rows) == (tokens, logprobs), rows


@pytest.mark.parametrize("quantization,dtype", CASES)
def test_without_the_flag_shows_where_a_batch_changes_the_result(tiny, quantization, dtype):
    # int4 copies for steps of at most 8 rows, dense above: as a calibrated executor would switch
    runner = ModelRunner(tiny, dtype=dtype, quantization=quantization, num_kv_blocks=1200,
                         int4_max_rows=8 if quantization == "int4" else None)
    target = prompt(random.Random(7), 37)
    tokens, logprobs = alone(runner, target)
    for rows in (1, 3, 17, 64):
        other_tokens, other_logprobs = in_company(runner, target, rows, seed=rows)
        diffs = [i for i, (a, b) in enumerate(zip(logprobs, other_logprobs, strict=True)) if a != b]
        print(f"without --deterministic ({quantization}, {dtype}), {rows} rows: tokens "
              f"{'same' if other_tokens == tokens else 'DIFFER'}, logprobs differ at outputs {diffs}"
              + (f" (first: top {logprobs[diffs[0]][3][:2]} vs {other_logprobs[diffs[0]][3][:2]})" if diffs else ""))


def test_the_mode_gives_each_linear_one_path(tiny):
    dense = ModelRunner(tiny, dtype="float32", quantization="none", num_kv_blocks=64, deterministic=True).model
    assert all(m.tile_rows == TILE_ROWS and m.int4 is None for m in dense.decoder_linears())
    assert dense.head_tile_rows == TILE_ROWS and dense.head_int8 is None
    quantized = ModelRunner(tiny, dtype="float32", quantization="int4", num_kv_blocks=64, deterministic=True).model
    assert all(type(m.int4) is Q4Weight and m.int4.max_rows == ALL_ROWS and m.int4.tiles_from == ALL_ROWS
               and not m.tile_rows for m in quantized.decoder_linears())
    assert type(quantized.head_int8) is Q8Weight and quantized.head_int8.max_rows == ALL_ROWS
    assert quantized.head_int8.tiles_from == ALL_ROWS
    # the C++ paged attention for every chunk, never the SDPA path of long ones (kernels.cpu.dense_attention)
    for model in (dense, quantized):
        if model.backend.row_invariant_paged_attention is not None:
            assert model.backend.paged_attention is model.backend.row_invariant_paged_attention


def test_compile_is_off_under_the_flag(tiny):
    runner = ModelRunner(tiny, dtype="float32", num_kv_blocks=64, deterministic=True, compile_decode=True)
    assert runner.graphs is None


# one unit test per op made (or found) row-invariant

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_linear_gives_a_row_the_same_bits_at_any_row_count(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(1536, 576, generator=g).to(dtype)
        x = torch.randn(130, 576, generator=g).to(dtype)
        alone_rows = torch.cat([tiled_linear(x[i : i + 1], w) for i in range(len(x))])
        for m in (2, 3, 17, 63, 64, 65, 130):
            assert torch.equal(tiled_linear(x[:m], w), alone_rows[:m]), m
            assert torch.equal(tiled_linear(x[-m:], w), alone_rows[-m:]), m  # rows at other tile positions
        close = F.linear(x.float(), w.float())
        assert torch.allclose(alone_rows.float(), close, rtol=2e-2, atol=2e-2 * float(close.abs().max()))
        # what the tiles are for: F.linear itself may pick another kernel by row count (printed, not asserted)
        differ = [m for m in (2, 8, 33, 64, 100) if not torch.equal(F.linear(x[:m], w), torch.cat(
            [F.linear(x[i : i + 1], w) for i in range(m)]))]
        print(f"F.linear {dtype} at {threads} threads: a row's bits change with the row count at M in {differ}")
    finally:
        torch.set_num_threads(before)


def test_q4_linear_gives_a_row_the_same_bits_at_any_row_count(tiny):
    model = ModelRunner(tiny, dtype="float32", quantization="int4", num_kv_blocks=64, deterministic=True).model
    for q in (model.decoder_linears()[0].int4, model.head_int8):
        x = torch.randn(70, 64, generator=torch.Generator().manual_seed(1))  # the tiny model's hidden size
        alone_rows = torch.cat([q.matmul(x[i : i + 1]) for i in range(len(x))])
        for m in (2, 5, 8, 9, 17, 70):
            assert torch.equal(q.matmul(x[-m:]), alone_rows[-m:]), m


def test_norms_rope_and_silu_are_per_row(tiny):
    backend = ModelRunner(tiny, dtype="float32", num_kv_blocks=64).backend
    g = torch.Generator().manual_seed(2)
    x, res, w = (torch.randn(40, 576, generator=g) for _ in range(3))
    w = w[0]
    norm = backend.rms_norm(x, w, 1e-5)
    assert torch.equal(torch.cat([backend.rms_norm(x[i : i + 1], w, 1e-5) for i in range(40)]), norm)
    fused = backend.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    rows = [backend.fused_add_rms_norm(x[i : i + 1].clone(), res[i : i + 1].clone(), w, 1e-5) for i in range(40)]
    assert torch.equal(torch.cat([r[0] for r in rows]), fused[0])
    gate_up = torch.randn(40, 2 * 1536, generator=g)
    assert torch.equal(torch.cat([backend.silu_and_mul(gate_up[i : i + 1]) for i in range(40)]),
                       backend.silu_and_mul(gate_up))
    heads, kv_heads, head_dim, block = 4, 2, 64, 16
    qkv = torch.randn(40, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randperm(200, generator=g)[:40]
    cos_sin = torch.randn(256, head_dim, generator=g)
    caches = [torch.zeros(8, block, kv_heads, head_dim) for _ in range(4)]
    slots = torch.randperm(8 * block, generator=g)[:40]
    q = backend.rope_and_cache(qkv.clone(), positions, cos_sin, caches[0], caches[1], slots, heads, kv_heads)
    q_rows = torch.cat([backend.rope_and_cache(qkv[i : i + 1].clone(), positions[i : i + 1], cos_sin, caches[2],
                                               caches[3], slots[i : i + 1], heads, kv_heads) for i in range(40)])
    assert torch.equal(q_rows, q) and torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_log_softmax_and_greedy_argmax_are_per_row():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(70, VOCAB, generator=g) * 5
    logits[5, [10, 20]] = 100.0  # a tie: the first maximum, in any batch
    full = torch.log_softmax(logits, -1)
    assert torch.equal(torch.cat([torch.log_softmax(logits[i : i + 1], -1) for i in range(70)]), full)
    picks = greedy_tokens(logits, list(range(70)))
    assert picks == [greedy_tokens(logits[i : i + 1], [0])[0] for i in range(70)] and picks[5] == 10
