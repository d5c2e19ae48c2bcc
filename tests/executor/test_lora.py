"""LoRA in the executor: rows under PEFT adapters equal PEFT's merged model in transformers
(greedy tokens, and logprobs within 1e-4), one step mixing 4 adapters and the base equals each
sequence run alone (grouped, stacked and both), a slot's adapter is swapped when a step names
another (the stacked slots with it), and an adapter whose files went bad fails its rows alone."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels.lora_stacked import cpu_kernel
from services.executor import lora_slots, lora_stack
from services.executor.model_runner import ModelRunner
from shared.lora_files import read_adapter
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep, LoraAdapter, ScheduledSeq, SeqSampling
from tests.executor.test_model_runner import BLOCK, make_model, prompts
from tests.lora_helpers import make_peft_adapter, merged_model

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=0)
LOGPROB_TOLERANCE = 1e-4  # float32: the delta as two low-rank matmuls against PEFT's merged weight
N_TOKENS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-base")
    make_model(path, "untied")
    return path


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Four adapters of different ranks and targets."""
    specs = [dict(rank=8, seed=1), dict(rank=4, seed=2, targets=("q_proj", "v_proj")),
             dict(rank=16, seed=3, targets=("o_proj", "down_proj", "gate_proj")), dict(rank=2, seed=4, use_rslora=True)]
    out = {}
    for i, spec in enumerate(specs):
        path = make_peft_adapter(base, tmp_path_factory.mktemp(f"adapter{i}"), scale=3.0, **spec)
        out[f"a{i}"] = LoraAdapter(f"a{i}", str(path), read_adapter(path).digest)
    return out


def runner(base, **kw):
    return ModelRunner(base, dtype="float32", quantization="none", block_size=BLOCK, num_kv_blocks=128,
                       lora_options=LoraOptions(max_loras=4, max_lora_rank=16, **kw))


def generate(runner: ModelRunner, jobs: list[tuple[list[int], LoraAdapter | None]], slots: dict[str, int]):
    """Greedy tokens and their logprobs of each (prompt, adapter), all in the same steps."""
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(jobs))]
    tokens = [list(p) for p, _ in jobs]
    out: list[list[int]] = [[] for _ in jobs]
    logprobs: list[list[float]] = [[] for _ in jobs]
    computed = [0] * len(jobs)
    for step_id in range(N_TOKENS):
        seqs, lora_slots = [], set()
        for i, (_, adapter) in enumerate(jobs):
            start, end = computed[i], len(tokens[i])
            slot = -1 if adapter is None else slots[adapter.name]
            if adapter is not None:
                lora_slots.add((slot, adapter))
            seqs.append(ScheduledSeq(
                request_id=f"r{i}", token_ids=tokens[i][start:end], start_pos=start, block_table=tables[i],
                slot_mapping=[tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)], sample=True,
                output_index=len(out[i]), sampling=GREEDY, lora_slot=slot))
        result = runner.run(ExecuteStep(step_id, seqs, lora_slots=sorted(lora_slots, key=lambda p: p[0])))
        assert not result.failed, result.failed
        for i, token in enumerate(result.sampled):
            computed[i] = len(tokens[i])
            tokens[i].append(token)
            out[i].append(token)
            logprobs[i].append(result.logprobs[i].logprob)
    return out, logprobs


def reference(base, adapter: LoraAdapter | None, prompt: list[int]):
    hf = merged_model(base, None if adapter is None else adapter.path)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=N_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = gen.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, tokens, strict=True)]
    return tokens, logprobs


def test_each_adapter_matches_peft_merged_model(base, adapters):
    r = runner(base)
    jobs = [(p, adapters[f"a{i}"]) for i, p in enumerate(prompts(5, [7, 19, 12, 30]))]
    jobs.append((prompts(6, [9])[0], None))
    out, logprobs = generate(r, jobs, {f"a{i}": i for i in range(4)})
    for (prompt, adapter), got, got_lp in zip(jobs, out, logprobs, strict=True):
        want, want_lp = reference(base, adapter, prompt)
        assert got == want, adapter
        assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < LOGPROB_TOLERANCE


def test_adapters_change_the_output(base, adapters):
    prompt = prompts(7, [10])[0]
    outs = {name: reference(base, a, prompt)[0] for name, a in [("base", None), *adapters.items()]}
    assert len({tuple(v) for v in outs.values()}) > 2


@pytest.mark.parametrize("stacked_fraction,kernel_rank,run_rows",
                         [(0.0, 0, 0), (0.5, 0, 0), (100.0, 0, 0), (0.5, 32, 0), (100.0, 32, 0), (100.0, 16, 0),
                          (100.0, 32, 5)],
                         ids=["grouped", "mixed", "stacked", "mixed-kernel", "stacked-kernel", "torch-and-kernel",
                              "kernel-and-runs"])
def test_mixed_batch_equals_each_alone(base, adapters, stacked_fraction, kernel_rank, run_rows, monkeypatch):
    """Whichever projections are stacked (kernels.lora_stacked, by torch or by the C++ kernel, whose
    rank limit leaves some projections to torch in "torch-and-kernel") and which grouped; in the
    last case prompt runs of 5 rows and more of one adapter go by torch matmuls beside the kernel."""
    if kernel_rank and cpu_kernel() is None:
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setattr(lora_stack, "MAX_STACKED_FRACTION", stacked_fraction)
    monkeypatch.setattr(lora_stack, "USE_CPU_KERNEL", bool(kernel_rank))
    monkeypatch.setattr(lora_stack, "KERNEL_MAX_RANK", kernel_rank)
    if run_rows:
        monkeypatch.setattr(lora_slots, "TORCH_RUN_ROWS", run_rows)
    r = runner(base)
    slots = {f"a{i}": 3 - i for i in range(4)}  # slots in another order than the rows
    names = ["a0", None, "a1", "a2", "a0", "a3", None, "a1"]
    jobs = [(p, adapters[n] if n else None) for p, n in zip(prompts(8, [5, 9, 14, 3, 22, 8, 11, 6]), names,
                                                            strict=True)]
    together, together_lp = generate(r, jobs, slots)
    for job, got, got_lp in zip(jobs, together, together_lp, strict=True):
        alone, alone_lp = generate(runner(base), [job], slots)
        assert got == alone[0]
        assert max(abs(a - b) for a, b in zip(got_lp, alone_lp[0], strict=True)) < LOGPROB_TOLERANCE


def test_slot_takes_another_adapter(base, adapters):
    r = runner(base, max_cpu_loras=1)
    prompt = prompts(9, [8])[0]
    first, _ = generate(r, [(prompt, adapters["a0"])], {"a0": 0})
    second, _ = generate(r, [(prompt, adapters["a3"])], {"a3": 0})  # slot 0 now holds a3
    third, _ = generate(r, [(prompt, adapters["a0"])], {"a0": 0})  # back from disk (the LRU holds one)
    assert first[0] == third[0] == reference(base, adapters["a0"], prompt)[0]
    assert second[0] == reference(base, adapters["a3"], prompt)[0]


def test_stacked_slots_follow_a_slot_change(base, adapters):
    r = runner(base)
    p = prompts(10, [7, 12, 5])
    generate(r, [(p[0], adapters["a0"]), (p[1], adapters["a1"])], {"a0": 0, "a1": 1})
    jobs = [(p[0], adapters["a3"]), (p[1], adapters["a1"]), (p[2], None)]  # slot 0 now holds a3
    got, _ = generate(r, jobs, {"a3": 0, "a1": 1})
    assert got == generate(runner(base), jobs, {"a3": 0, "a1": 1})[0]
    assert got[0] == reference(base, adapters["a3"], p[0])[0]


def test_changed_files_fail_their_rows_alone(base, adapters, tmp_path):
    copy = shutil.copytree(adapters["a0"].path, tmp_path / "copy")
    adapter = LoraAdapter("bad", str(copy), adapters["a0"].digest)
    (copy / "adapter_model.safetensors").write_bytes(b"garbage")
    r = runner(base)
    seqs = [ScheduledSeq(request_id=f"r{i}", token_ids=[5, 6, 7], start_pos=0, block_table=[i],
                         slot_mapping=[i * BLOCK + k for k in range(3)], sample=True, output_index=0, sampling=GREEDY,
                         lora_slot=slot) for i, slot in enumerate([0, -1, 1])]
    result = r.run(ExecuteStep(1, seqs, lora_slots=[(0, adapter), (1, adapters["a1"])]))
    assert [f.index for f in result.failed] == [0] and result.failed[0].status == 400
    assert "bad" in result.failed[0].message and "changed" in result.failed[0].message
    assert result.sampled[1] >= 0 and result.sampled[2] >= 0


def stacked_state(stacked: lora_stack.StackedSlots) -> list:
    """Per layer and projection: None, or its form and each slot's live columns of A and B^T and
    their output blocks (relative to the slot's first column): what a step reads."""
    out = []
    for row in stacked.layers:
        for t in row:
            if t is None:
                out.append(None)
                continue
            ranges = stacked.layouts.ranges[t.layout]
            slots = {}
            for slot, (c0, c1) in sorted(ranges.items()):
                mine = t.blocks[(t.blocks[:, 0] >= c0) & (t.blocks[:, 1] <= c1)] - torch.tensor([c0, c0, 0, 0])
                slots[slot] = (t.a[c0:c1], t.bt[c0:c1], mine)
            out.append((t.kernel, slots))
    return out


def assert_same_table(got: lora_stack.StackedSlots, fresh: lora_stack.StackedSlots) -> None:
    assert got.any_torch == fresh.any_torch
    for g, f in zip(stacked_state(got), stacked_state(fresh), strict=True):
        assert (g is None) == (f is None)
        if g is not None:
            assert g[0] == f[0] and g[1].keys() == f[1].keys()
            for slot in g[1]:
                assert all(torch.equal(x, y) for x, y in zip(g[1][slot], f[1][slot], strict=True)), slot


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_stacked_table_updated_in_place_equals_a_fresh_one(base, adapters, kernel, monkeypatch):
    """Slots refilled in turn (wider and narrower adapters, one brought back): the table, updated
    in place, reads as one built afresh from the slots, a steady step copies no weights, a slot
    change within its region copies that slot's only, and the outputs stay those of a fresh runner."""
    if kernel and cpu_kernel() is None:
        pytest.skip("the C++ CPU kernels are not built")
    monkeypatch.setattr(lora_stack, "MAX_STACKED_FRACTION", 100.0)
    monkeypatch.setattr(lora_stack, "USE_CPU_KERNEL", kernel)
    r = runner(base)
    p = prompts(11, [6, 9, 4])
    a = adapters
    # slot 0 widens under slot 1's live columns (which move), narrows, and a0 comes back
    sequence = [{"a3": 0, "a1": 1}, {"a0": 0, "a1": 1}, {"a2": 0, "a1": 1}, {"a2": 0, "a3": 1},
                {"a0": 1, "a2": 0, "a1": 3}, {"a3": 1, "a2": 0, "a1": 3}, {"a0": 0, "a3": 1, "a2": 3}]
    for slots in sequence:
        jobs = [(prompt, a[name]) for prompt, name in zip(p, slots, strict=False)]
        got, _ = generate(r, jobs, slots)
        assert got == generate(runner(base), jobs, slots)[0]
        stacked = r.loras._stacked
        assert_same_table(stacked, lora_stack.StackedSlots(r.loras.slots, r.device, r.dtype))

    copies = stacked.copies
    buffers = [(t.a.data_ptr(), t.bt.data_ptr()) for row in stacked.tables for t in row if t.a is not None]
    generate(r, jobs, slots)  # the same slots again: nothing to copy
    assert stacked.copies == copies
    generate(r, [(p[0], a["a1"])], {"a1": 1})  # a3 (rank 2) leaves slot 1 for a1 (rank 4 on q and v)
    targeted = sum(t is not None for layer in r.loras.slots[1].layers for t in layer)
    assert stacked.copies == copies + targeted  # a1's own projections, no regrowth
    assert buffers == [(t.a.data_ptr(), t.bt.data_ptr()) for row in stacked.tables for t in row if t.a is not None]
    assert_same_table(stacked, lora_stack.StackedSlots(r.loras.slots, r.device, r.dtype))
