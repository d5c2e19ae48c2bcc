"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over the paged KV cache.

Numerics follow transformers' LlamaForCausalLM (float32 RMSNorm statistics, RoPE in
the activation dtype) so outputs match it. Differences in form only: q/k/v and
gate/up projections are fused into one matmul each (fewer, larger matmuls are what a
CPU wants); the elementwise work between matmuls runs as the backend's fused ops
(residual add + RMSNorm, RoPE + KV cache write, SiLU-and-mul: one pass each in the
C++ CPU backend, plain torch in the reference); logits are computed only for the rows
that get sampled. Rows under LoRA adapters (`meta.lora`, `services.executor.lora_slots`) get
their adapter's low-rank delta added to each projection's output
(`services.executor.lora_batch.LayerDeltas`). Every per-step input comes from a
`BatchMetadata`; attention and
the fused ops go through an `AttentionBackend`.

The modules hold the weights (loading, quantization and sharding address them by
name); a layer's computation is `decoder_layer`, one plain function over the
`LayerCalls` each layer hands out once: going through nn.Module's `__call__` and
`__getattr__` for every projection and norm cost ~75 us a layer, 2.3 ms of a 13 ms
decode step of SmolLM2 at one sequence on a 2-core AVX2 CPU.

Tensor parallelism (`TPGroup` of size > 1; `models.sharding` says who holds what):
the fused QKV and gate/up projections are column-parallel (each rank holds its heads'
rows, its share of the intermediate columns), o_proj and down_proj row-parallel, with
one all-reduce after each (their bias, if any, is kept by rank 0 only, so it is added
once). The embedding and the head are vocab-parallel: an embedding row is looked up
by the rank that holds it (zeros elsewhere) and summed over the ranks; each rank's
head shard gives its logits columns, gathered on rank 0, whose `forward` alone returns
logits. RMSNorm weights and RoPE are replicated. LoRA deltas follow the same split
(`services.executor.lora_shard`): a row-parallel projection's partial delta joins its
partial output before the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.attention import AttentionBackend
from services.executor.batch import BatchMetadata
from services.executor.deterministic import tiled_linear
from services.executor.lora_batch import LayerDeltas
from services.executor.models.sharding import ModelShard
from services.executor.prepack import PackedWeight, packed_or_dense
from services.executor.quantization import Int4Weight, Int8Weight, Q4Weight, Q8Weight
from services.executor.tp_group import TPGroup

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ACTIVATIONS = ("silu",)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


REUSED_ROWS = 16  # steps of at most this many rows write `Linear.step_forward`'s outputs into kept buffers


class Linear(nn.Linear):
    """A dense linear that may also hold an int4 copy of its weight, used for calls of few rows."""

    int4: Int4Weight | Q4Weight | None = None
    packed: PackedWeight | None = None  # oneDNN-blocked copy for dense calls (services.executor.prepack)
    _out: Tensor | None = None  # step_forward's buffer, [REUSED_ROWS, out_features] float32
    tile_rows: int = 0  # --deterministic: dense calls this many rows at a time (services.executor.deterministic)

    def forward(self, x: Tensor) -> Tensor:
        q, bias = self.int4, self._parameters["bias"]  # (not through Module.__getattr__: 120 calls a step)
        if q is not None and x.shape[0] <= q.max_rows:
            y = q.matmul(x)
            return y if bias is None else y + bias
        if self.tile_rows:
            return tiled_linear(x, self.weight, bias, self.tile_rows)
        return packed_or_dense(self.packed, x, self.weight, bias)

    def step_forward(self, x: Tensor) -> Tensor:
        """`forward` for the model's forward pass, which reads a projection's output before it calls
        that projection again: a step of few rows through `q4_linear` writes into a buffer this
        linear keeps, valid until its next call. A new output tensor took ~3.6 us of the ~10 us of
        a one-row projection (120 a step) on an AVX2 CPU."""
        q, n = self.int4, x.shape[0]
        if (type(q) is not Q4Weight or n > q.max_rows or n > REUSED_ROWS or x.dtype != torch.float32
                or self._parameters["bias"] is not None or torch.compiler.is_compiling()):
            return self.forward(x)
        out = self._out
        if out is None:
            out = self._out = torch.empty(REUSED_ROWS, q.out_features, dtype=torch.float32, device=x.device)
        return q.matmul(x, out[:n])

    def gate_up_silu(self, x: Tensor, ops: AttentionBackend) -> Tensor:
        """silu(gate) * up for this gate/up projection (its first half of rows the gate's, as MLP stacks
        them): in one kernel where the call runs on AMX tiles (the int4 copy's or the prepacked tiles'),
        which combines each gate block with its up block as it stores them, the same bits as the matmul
        and `silu_and_mul` in turn; else those two. Fused, SmolLM2's 30 gate/up projections and their SiLU
        took 0.55-0.97x the time at 32-512 rows on the int4 tiles, 0.73-0.83x on the dense tiles (AMX
        Xeon, weights from DRAM): half the output written and read back, and a pair of blocks (a gate's,
        an up's) for every A tile loaded."""
        n, q, packed = x.shape[0], self.int4, self.packed
        if (x.dtype == torch.bfloat16 and self.out_features % 32 == 0 and self._parameters["bias"] is None
                and not torch.compiler.is_compiling()):
            if q is not None and n <= q.max_rows:
                if type(q) is Q4Weight and q.on_tiles(x) and ops.q4_gate_up_silu_tiles is not None:
                    return ops.q4_gate_up_silu_tiles(x, q.packed, q.d, q.m)
            elif (not self.tile_rows and packed is not None and packed.tiles_op is not None and n <= packed.max_rows
                  and ops.bf16_gate_up_silu_tiles is not None):
                return ops.bf16_gate_up_silu_tiles(x, packed.packed)
        return ops.silu_and_mul(self.step_forward(x))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class RotaryEmbedding:
    """cos/sin for arbitrary positions, with the config's rope type (default, llama3, linear, ...).

    Dynamic NTK scaling is evaluated at max_position_embeddings, which is what
    transformers does for any sequence that fits in it (and max_model_len is that).
    """

    def __init__(self, config, device: torch.device | str):
        params = config.rope_parameters or {}
        rope_type = params.get("rope_type", "default")
        dim = head_dim_of(config)
        # built outside any meta-device context the model may be constructed in
        with torch.device(device):
            if rope_type == "default":
                base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                self.scaling = 1.0
            elif rope_type in ROPE_INIT_FUNCTIONS:
                self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device(device))
            else:
                raise ValueError(f"unsupported rope type {rope_type!r}")
        if self.inv_freq.numel() * 2 != dim:
            raise ValueError("partial rotary embeddings are not supported")

    def table(self, max_positions: int, dtype: torch.dtype) -> Tensor:
        """[max_positions, head_dim] float32: cos | sin of each position, rounded through dtype
        (transformers casts them to the activation dtype)."""
        freqs = torch.arange(max_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        return torch.cat((freqs.cos() * self.scaling, freqs.sin() * self.scaling), dim=-1).to(dtype).float()


class MergedLinear(Linear):
    """Several projections of the same input stacked into one weight; shards name their rows."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shards[name] = (offset, size)
            offset += size


class VocabEmbedding(nn.Embedding):
    """The embedding, or this rank's rows of it (`shard.vocab`, padded to `shard.vocab_rows`)."""

    def __init__(self, shard: ModelShard, hidden_size: int, tp: TPGroup):
        super().__init__(shard.vocab_rows, hidden_size)
        self.shard, self.tp = shard, tp

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.shard.vocab.start
        outside = (local < 0) | (local >= len(self.shard.vocab))
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


class Attention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, sliding_window: int | None, shard: ModelShard):
        super().__init__()
        self.num_heads = len(shard.q_heads)  # this rank's
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window


class MLP(nn.Module):
    def __init__(self, config, shard: ModelShard):
        super().__init__()
        if config.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"activation {config.hidden_act!r} is not one of {SUPPORTED_ACTIVATIONS}")
        size, bias = len(shard.intermediate), getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias)
        self.down_proj = Linear(size, config.hidden_size, bias=bias)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, shard: ModelShard):
        super().__init__()
        qwen2 = config.model_type == "qwen2"
        attention_bias = getattr(config, "attention_bias", False)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
            window = None
        self.self_attn = Attention(config, qkv_bias=attention_bias or qwen2, o_bias=attention_bias and not qwen2,
                                   sliding_window=window, shard=shard)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def calls(self) -> LayerCalls:
        attn, mlp = self.self_attn, self.mlp
        return LayerCalls(
            self.input_layernorm.weight, self.input_layernorm.eps, attn.qkv_proj.step_forward,
            attn.o_proj.step_forward, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
            mlp.gate_up_proj.step_forward, mlp.down_proj.step_forward, attn.num_heads, attn.num_kv_heads,
            attn.scale, attn.sliding_window, mlp.gate_up_proj.gate_up_silu,
        )


class LayerCalls(NamedTuple):
    """What one decoder layer's computation reads, looked up once (the Parameters and the
    projections' bound `step_forward`s stay valid as weights load, move or gain int4 copies)."""

    input_norm: Tensor
    input_eps: float
    qkv_proj: Callable[[Tensor], Tensor]
    o_proj: Callable[[Tensor], Tensor]
    post_norm: Tensor
    post_eps: float
    gate_up_proj: Callable[[Tensor], Tensor]
    down_proj: Callable[[Tensor], Tensor]
    num_heads: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None
    gate_up_silu: Callable[[Tensor, AttentionBackend], Tensor]  # silu(gate) * up (gate_up_proj, then silu_and_mul)


def decoder_layer(ops: AttentionBackend, tp: TPGroup, layer: LayerCalls, x: Tensor, residual: Tensor | None,
                  cos_sin: Tensor, meta: BatchMetadata, k_cache: Tensor, v_cache: Tensor,
                  lora: LayerDeltas | None = None) -> tuple[Tensor, Tensor]:
    """One decoder layer: (mlp output, residual stream before it); the next layer adds the two
    in its first fused norm. lora: this layer's LoRA deltas of the step."""
    if lora is not None:
        return _lora_decoder_layer(ops, tp, layer, x, residual, cos_sin, meta, k_cache, v_cache, lora)
    if residual is None:
        x, residual = ops.rms_norm(x, layer.input_norm, layer.input_eps), x
    else:
        x, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, layer.input_eps)
    q = ops.rope_and_cache(layer.qkv_proj(x), meta.positions, cos_sin, k_cache, v_cache, meta.slot_mapping,
                           layer.num_heads, layer.num_kv_heads)
    out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                              layer.scale, layer.sliding_window)
    x = tp.all_reduce(layer.o_proj(out.view(x.shape[0], -1)))
    x, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, layer.post_eps)
    return tp.all_reduce(layer.down_proj(layer.gate_up_silu(x, ops))), residual


def _lora_decoder_layer(ops: AttentionBackend, tp: TPGroup, layer: LayerCalls, x: Tensor, residual: Tensor | None,
                        cos_sin: Tensor, meta: BatchMetadata, k_cache: Tensor, v_cache: Tensor,
                        lora: LayerDeltas) -> tuple[Tensor, Tensor]:
    """`decoder_layer` with each projection's LoRA deltas added to its rows. Under tensor parallelism a
    row-parallel projection's delta is this rank's partial one (`lora_shard`), added before the
    all-reduce that sums the partial outputs (the bias, on rank 0 alone, is in them once)."""
    if residual is None:
        x, residual = ops.rms_norm(x, layer.input_norm, layer.input_eps), x
    else:
        x, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, layer.input_eps)
    qkv = layer.qkv_proj(x)
    lora.add(0, x, qkv)
    q = ops.rope_and_cache(qkv, meta.positions, cos_sin, k_cache, v_cache, meta.slot_mapping,
                           layer.num_heads, layer.num_kv_heads)
    out = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                              layer.scale, layer.sliding_window)
    attn = out.view(x.shape[0], -1)
    x = layer.o_proj(attn)
    lora.add(1, attn, x)
    x = tp.all_reduce(x)
    x, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, layer.post_eps)
    gate_up = layer.gate_up_proj(x)
    lora.add(2, x, gate_up)
    act = ops.silu_and_mul(gate_up)
    down = layer.down_proj(act)
    lora.add(3, act, down)
    return tp.all_reduce(down), residual


class LlamaModel(nn.Module):
    def __init__(self, config, shard: ModelShard, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint projection -> (our fused module, its shard)
    STACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config, backend: AttentionBackend, device: torch.device | str = "cpu",
                 tp: TPGroup | None = None):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        self.config = config
        self.tp = tp or TPGroup.single()
        self.shard = ModelShard.of(config.num_attention_heads, num_kv_heads_of(config), config.intermediate_size,
                                   config.vocab_size, self.tp.rank, self.tp.size)
        self.model = LlamaModel(config, self.shard, self.tp)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, self.shard.vocab_rows, bias=False)
        self.rotary = RotaryEmbedding(config, device)
        self.backend = backend
        self._cos_sin: Tensor | None = None
        self._layer_calls: list[LayerCalls] | None = None
        self.head_int8: Int8Weight | Q8Weight | None = None  # see services.executor.quantization
        self.head_tile_rows = 0  # as Linear.tile_rows
        self.head_packed: PackedWeight | None = None  # as Linear.packed

    def cos_sin(self, dtype: torch.dtype) -> Tensor:
        if self._cos_sin is None or self._cos_sin.device != self.rotary.inv_freq.device:
            self._cos_sin = self.rotary.table(self.config.max_position_embeddings, dtype)
        return self._cos_sin

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's pool holds."""
        return len(self.shard.kv_heads)

    def forward(self, meta: BatchMetadata, k_caches: list[Tensor], v_caches: list[Tensor]) -> Tensor | None:
        """Float32 logits [num_sampled, vocab] for meta.sample_indices, in that order
        (on rank 0; None on the other ranks of a tensor-parallel group)."""
        x, residual = self._decode_layers(meta, k_caches, v_caches)
        return self.logits(self._final_norm(x, residual, meta.sample_indices))

    def forward_pooled(self, meta: BatchMetadata, k_caches: list[Tensor], v_caches: list[Tensor],
                       pool_rows: Tensor) -> tuple[Tensor | None, Tensor]:
        """`forward`'s logits, and the final normed hidden states [len(pool_rows), hidden] of the
        token rows pool_rows (embedding requests, `services.executor.pooling`; every rank has them)."""
        x, residual = self._decode_layers(meta, k_caches, v_caches)
        hidden = self._final_norm(x, residual, pool_rows)
        return self.logits(self._final_norm(x, residual, meta.sample_indices)), hidden

    def _decode_layers(self, meta: BatchMetadata, k_caches: list[Tensor], v_caches: list[Tensor],
                       ) -> tuple[Tensor, Tensor]:
        x = self.model.embed_tokens(meta.input_ids)
        cos_sin = self.cos_sin(x.dtype)
        if self._layer_calls is None:
            self._layer_calls = [layer.calls() for layer in self.model.layers]
        ops, tp, residual = self.backend, self.tp, None
        lora = getattr(meta, "lora", None)
        if lora is not None and lora.groups:
            for i, (layer, k_cache, v_cache) in enumerate(zip(self._layer_calls, k_caches, v_caches, strict=True)):
                x, residual = decoder_layer(ops, tp, layer, x, residual, cos_sin, meta, k_cache, v_cache,
                                            lora.layer(i))
            return x, residual
        for layer, k_cache, v_cache in zip(self._layer_calls, k_caches, v_caches, strict=True):
            x, residual = decoder_layer(ops, tp, layer, x, residual, cos_sin, meta, k_cache, v_cache)
        return x, residual

    def _final_norm(self, x: Tensor, residual: Tensor, rows: Tensor) -> Tensor:
        norm = self.model.norm
        return self.backend.rms_norm(x[rows] + residual[rows], norm.weight, norm.eps)

    def logits(self, x: Tensor) -> Tensor | None:
        """Float32 logits of final hidden states: the head's int8 copy for few rows, if it has one
        (under tensor parallelism each rank's vocab columns, gathered on rank 0)."""
        q = self.head_int8
        if q is not None and x.shape[0] <= q.max_rows:
            logits = q.matmul(x).float()
        elif self.head_tile_rows:
            logits = tiled_linear(x, self.head_weight(), None, self.head_tile_rows).float()
        else:
            logits = packed_or_dense(self.head_packed, x, self.head_weight(), None).float()
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather(logits)
        return None if logits is None else logits[:, : self.config.vocab_size]

    def head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    def decoder_linears(self) -> list[Linear]:
        """The projections of every decoder layer (what `--quantization` applies to; not the head)."""
        return [m for m in self.model.layers.modules() if isinstance(m, Linear)]

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy checkpoint tensors (transformers' names) in; raises unless every weight is set."""
        params = dict(self.named_parameters())
        expected = set()
        for name in params:
            module = self.get_submodule(name.rsplit(".", 1)[0])
            shards = module.shards if isinstance(module, MergedLinear) else {None: None}
            expected |= {(name, shard) for shard in shards}
        loaded = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name or (self.tied and hf_name == "lm_head.weight"):
                continue
            name, shard = hf_name, None
            for proj, (fused, shard_name) in self.STACKED.items():
                if f".{proj}." in hf_name:
                    name, shard = hf_name.replace(f".{proj}.", f".{fused}."), shard_name
                    break
            if name not in params:
                raise KeyError(f"checkpoint weight {hf_name!r} has no place in the model")
            target = params[name].data
            if shard is not None:
                offset, size = self.get_submodule(name.rsplit(".", 1)[0]).shards[shard]
                target = target.narrow(0, offset, size)
            if self.tp.size > 1:
                target, tensor = self._shard_of(name, shard, target, tensor)
            if target.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add((name, shard))
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {sorted(str(m) for m in missing)[:5]} ({len(missing)} in all)")

    def _shard_of(self, name: str, shard: str | None, target: Tensor, tensor: Tensor) -> tuple[Tensor, Tensor]:
        """(where in this rank's parameter, which part of the checkpoint tensor) for one weight."""
        s, head_dim = self.shard, head_dim_of(self.config)
        rows = {"q": s.q_heads, "k": s.kv_heads, "v": s.kv_heads}.get(shard)
        if rows is not None:
            return target, tensor.narrow(0, rows.start * head_dim, len(rows) * head_dim)
        if shard in ("gate", "up"):
            return target, tensor.narrow(0, s.intermediate.start, len(s.intermediate))
        row_parallel = {".o_proj.": range(s.q_heads.start * head_dim, s.q_heads.stop * head_dim),
                        ".down_proj.": s.intermediate}
        for part, cols in row_parallel.items():
            if part in name:
                if name.endswith(".bias"):  # added once, after the all-reduce
                    return target, tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
                return target, tensor.narrow(1, cols.start, len(cols))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            target.zero_()  # the padding rows past the vocabulary
            return target.narrow(0, 0, len(s.vocab)), tensor.narrow(0, s.vocab.start, len(s.vocab))
        return target, tensor
