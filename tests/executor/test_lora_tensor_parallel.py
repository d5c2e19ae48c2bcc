"""LoRA adapters under tensor parallelism.

- Shares (in process): each rank's share of a PEFT adapter (`lora_shard`) gives the exact
  delta of the rank's outputs on the column-parallel projections (q/k/v, gate/up) and a
  partial delta on the row-parallel ones (o, down) that sums over the ranks to the whole;
  its B's zero blocks are where they are declared.
- Agreement (in process): a fill another rank failed fails its rows here too and leaves the
  slot as it was.
- Logits (real processes, `tests.executor.tp_ranks`, as tests/executor/test_tensor_parallel.py):
  TP=2 against TP=1 in float32 with `--quantization none`, one batch mixing three adapters, the
  base and an adapter whose files changed (its rows fail, on rank 0, and the rest is unaffected):
  every step's logits within 1e-4 and so the greedy tokens equal, on a SmolLM2-like shape
  (6 query heads, 3 KV heads split unevenly 2 / 1, an odd intermediate size split 65 / 64)
  and on one whose single KV head is replicated on both ranks.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernels.lora_stacked import column_blocks
from services.executor.lora_shard import shard_lora
from services.executor.lora_slots import ExecutorLoras
from services.executor.lora_weights import load_lora
from services.executor.models.sharding import ModelShard
from services.executor.tp_group import TPGroup
from shared.lora_files import BaseShapes, read_adapter
from shared.lora_options import LoraOptions
from shared.messages import ExecuteStep, LoraAdapter, ScheduledSeq
from tests.executor.test_model_runner import GREEDY, TINY, prompts
from tests.executor.test_tensor_parallel import MAX_TOKENS, TOLERANCE, run_tp2
from tests.executor.tp_ranks import drive, make_runner
from tests.lora_helpers import make_peft_adapter

SHAPES = {
    "uneven": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=129),
    "replicated": dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=130),
}
ADAPTERS = [dict(rank=8, seed=1), dict(rank=4, seed=2, targets=("q_proj", "v_proj", "o_proj", "down_proj")),
            dict(rank=16, seed=3, targets=("k_proj", "gate_proj", "up_proj"))]


def make_base(path, shape: str):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**TINY, **SHAPES[shape]}, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        hf.model.embed_tokens.weight.normal_(0, 1.0)
    hf.save_pretrained(path)
    return hf.config


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request, tmp_path_factory):
    """(base dir, its config, its adapters)."""
    path = tmp_path_factory.mktemp(f"base-{request.param}")
    config = make_base(path, request.param)
    adapters = []
    for i, spec in enumerate(ADAPTERS):
        out = make_peft_adapter(path, tmp_path_factory.mktemp(f"{request.param}-a{i}"), scale=3.0, **spec)
        adapters.append(LoraAdapter(f"a{i}", str(out), read_adapter(out).digest))
    return path, config, adapters


def shards(config) -> list[ModelShard]:
    return [ModelShard.of(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
                          config.vocab_size, rank, 2) for rank in range(2)]


def test_rank_shares_give_the_whole_delta(model):
    path, config, adapters = model
    base = BaseShapes.of_config(config)
    head_dim = config.hidden_size // config.num_attention_heads
    whole = load_lora(adapters[0], base, 16, torch.float32, "cpu")
    parts = [shard_lora(whole, s, head_dim, base) for s in shards(config)]
    q_size, kv_size = base.projections["q_proj"][1], base.projections["k_proj"][1]
    inter = config.intermediate_size
    x = torch.randn(5, config.hidden_size, dtype=torch.float64)
    for i, layer in enumerate(whole.layers):
        for proj in ("qkv", "gate_up"):
            full = x @ getattr(layer, proj).a.double().t() @ getattr(layer, proj).b.double().t()
            for s, part in zip(shards(config), parts, strict=True):
                if proj == "qkv":
                    q = range(s.q_heads.start * head_dim, s.q_heads.stop * head_dim)
                    kv = range(s.kv_heads.start * head_dim, s.kv_heads.stop * head_dim)
                    cols = [*q, *(q_size + c for c in kv), *(q_size + kv_size + c for c in kv)]
                else:
                    cols = [*s.intermediate, *(inter + c for c in s.intermediate)]
                t = getattr(part.layers[i], proj)
                torch.testing.assert_close(x @ t.a.double().t() @ t.b.double().t(), full[:, cols])
                assert torch.equal(t.blocks, column_blocks(t.b.t())), (i, proj, s.rank)
        for proj, width in (("o", q_size), ("down", inter)):
            target = getattr(layer, proj)
            inputs = torch.randn(5, width, dtype=torch.float64)
            full = inputs @ target.a.double().t() @ target.b.double().t()
            total = torch.zeros_like(full)
            for s, part in zip(shards(config), parts, strict=True):
                cols = (range(s.q_heads.start * head_dim, s.q_heads.stop * head_dim) if proj == "o"
                        else s.intermediate)
                t = getattr(part.layers[i], proj)
                total += inputs[:, cols.start : cols.stop] @ t.a.double().t() @ t.b.double().t()
            torch.testing.assert_close(total, full)
    assert sum(p.nbytes for p in parts) < 2 * whole.nbytes


class OtherRankFailed(TPGroup):
    """A group whose other rank failed every fill of this step."""

    def any_flags(self, flags: list[bool]) -> list[bool]:
        return [True] * len(flags)


def test_a_fill_failed_on_another_rank_fails_its_rows_here(model):
    path, config, adapters = model
    base = BaseShapes.of_config(config)
    shard = shards(config)[0]
    loras = ExecutorLoras(LoraOptions(max_loras=2, max_lora_rank=16), base, torch.float32, torch.device("cpu"),
                          OtherRankFailed(0, 2), shard, config.hidden_size // config.num_attention_heads)
    seq = ScheduledSeq(request_id="r", token_ids=[1, 2], start_pos=0, block_table=[0], slot_mapping=[0, 1],
                       sample=True, output_index=0, sampling=GREEDY, lora_slot=1)
    batch = loras.prepare(ExecuteStep(1, [seq], lora_slots=[(1, adapters[0])]), [2])
    assert list(batch.failed) == [0] and "a0" in batch.failed[0] and "every tensor-parallel rank" in batch.failed[0]
    assert loras.slots == [None, None] and not batch.groups  # the slot as it was; the row runs as the base


def test_tp2_adapters_logits_equal_tp1(model, tmp_path):
    path, config, adapters = model
    bad_dir = shutil.copytree(adapters[0].path, tmp_path / "bad")
    with open(bad_dir / "adapter_config.json", "a") as f:
        f.write(" ")  # a digest of its own: no rank finds it in its host cache
    bad = LoraAdapter("bad", str(bad_dir), read_adapter(bad_dir).digest)
    (bad_dir / "adapter_model.safetensors").write_bytes(b"garbage")  # changed since it was registered
    loras = [adapters[0], None, adapters[1], adapters[2], bad, adapters[0]]
    prompt_ids = prompts(3, [5, 9, 3, 12, 4, 7])
    got = run_tp2(str(path), prompt_ids, tmp_path / "tp2.pt",
                  ("--loras", json.dumps([None if a is None else [a.name, a.path, a.digest] for a in loras])))
    torch.set_num_threads(1)  # as the ranks: the same matmul blocking
    failed: set[int] = set()
    ref_logits, ref_tokens = drive(make_runner(str(path), TPGroup.single()), TPGroup.single(), prompt_ids,
                                   MAX_TOKENS, loras, failed)
    assert got["lora_failed"] == sorted(failed) == [4]
    worst = 0.0
    for step, (a, b) in enumerate(zip(got["logits"], ref_logits, strict=True)):
        diff = (a - b).abs().max().item()
        assert diff <= TOLERANCE, f"step {step}: logits differ by {diff}"
        lp_diff = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max().item()
        assert lp_diff <= 2 * TOLERANCE, f"step {step}: logprobs differ by {lp_diff}"
        worst = max(worst, diff)
    assert got["tokens"] == ref_tokens
    # the adapters change the output (else the comparison above would prove little)
    base_logits, _ = drive(make_runner(str(path), TPGroup.single()), TPGroup.single(), prompt_ids, 1)
    assert all((base_logits[0][i] - ref_logits[0][i]).abs().max() > 0.1 for i in (0, 2, 3, 5))
    torch.testing.assert_close(base_logits[0][[1, 4]], ref_logits[0][[1, 4]], atol=1e-5, rtol=0)
    print(f"LoRA TP 2 vs 1: logits differ by at most {worst:.2e}")
