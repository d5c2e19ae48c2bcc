"""The lean-loop ceiling: a plain-torch greedy decode loop over a contiguous KV cache.

Same weights as the served model (read through transformers, then kept as plain tensors:
QKV and gate/up fused, RoPE tables precomputed), B sequences of the same length, one
preallocated [layers, B, kv_heads, max_len, head_dim] cache, `scaled_dot_product_attention`
with GQA, no scheduler, no paging, no messages, no sampling beyond argmax. What a server
adds on top of this loop is its own cost; what this loop reaches bounds a server that
runs the same torch kernels. `greedy` is checked against transformers' `generate` in tests.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class LeanDecoder:
    def __init__(self, model_dir: Path | str, dtype: torch.dtype, batch: int, max_len: int) -> None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = hf.config
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("the lean loop has no projection biases")
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps, self.dtype = cfg.rms_norm_eps, dtype

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype).contiguous()

        self.layers = []
        for layer in hf.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((w(layer.input_layernorm.weight),
                                w(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                                w(a.o_proj.weight), w(layer.post_attention_layernorm.weight),
                                w(torch.cat([m.gate_proj.weight, m.up_proj.weight])), w(m.down_proj.weight)))
        self.embed, self.norm, self.head = w(hf.model.embed_tokens.weight), w(hf.model.norm.weight), w(hf.lm_head.weight)
        with torch.no_grad():
            cos, sin = hf.model.rotary_emb(torch.zeros(1), torch.arange(max_len)[None])
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)  # [max_len, head_dim]
        shape = (len(self.layers), batch, self.kv_heads, max_len, self.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.batch, self.max_len = batch, max_len
        del hf

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = self.cos[pos:pos + x.shape[2]], self.sin[pos:pos + x.shape[2]]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def step(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """Tokens [B, T] at positions pos..pos+T-1 (pos 0: a prefill); returns each row's greedy next token."""
        return self.logits(tokens, pos).argmax(-1)

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """The next-token logits [B, vocab] after tokens [B, T] at positions pos..pos+T-1, cached."""
        b, t = tokens.shape
        hd, nq, nkv = self.head_dim, self.heads, self.kv_heads
        h = self.embed[tokens]
        for i, (ln1, wqkv, wo, ln2, wgu, wdown) in enumerate(self.layers):
            x = F.rms_norm(h, (h.shape[-1],), ln1, self.eps)
            q, k, v = F.linear(x, wqkv).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(b, t, nq, hd).transpose(1, 2), pos)
            self.k[i, :, :, pos:pos + t] = self._rope(k.view(b, t, nkv, hd).transpose(1, 2), pos)
            self.v[i, :, :, pos:pos + t] = v.view(b, t, nkv, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, self.k[i, :, :, :pos + t], self.v[i, :, :, :pos + t],
                                               is_causal=t > 1, enable_gqa=True)
            h = h + F.linear(o.transpose(1, 2).reshape(b, t, nq * hd), wo)
            x = F.rms_norm(h, (h.shape[-1],), ln2, self.eps)
            gate, up = F.linear(x, wgu).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, wdown)
        last = F.rms_norm(h[:, -1], (h.shape[-1],), self.norm, self.eps)
        return F.linear(last, self.head)

    def greedy(self, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[float]]:
        """Prefill `prompt` [B, P] then `steps` decode steps; the tokens [B, steps+1] and each step's seconds."""
        if prompt.shape[1] + steps > self.max_len:
            raise ValueError("prompt + steps exceed the cache")
        token = self.step(prompt, 0)
        out, times = [token], []
        for s in range(steps):
            start = time.perf_counter()
            token = self.step(token[:, None], prompt.shape[1] + s)
            times.append(time.perf_counter() - start)
            out.append(token)
        return torch.stack(out, dim=1), times


def ceiling(model_dir: Path | str, dtype: torch.dtype, batch: int = 64, context: int = 128, steps: int = 32,
            vocab_floor: int = 100) -> dict:
    """Decode tok/s of the lean loop at `batch`, prompts of `context` tokens, median over the steps."""
    decoder = LeanDecoder(model_dir, dtype, batch, context + steps + 1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab_floor, decoder.embed.shape[0], (batch, context), generator=gen)
    _, times = decoder.greedy(prompt, steps)
    step = statistics.median(times[2:] if len(times) > 4 else times)
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "steps": steps,
            "step_ms": step * 1e3, "tok_s": batch / step}
