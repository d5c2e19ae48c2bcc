"""Turns each sampled row of logits into a token: greedy, or temperature / min-p / top-k / top-p sampling.

The logits processors (allowed tokens, min_tokens, logit_bias, penalties: see
`logits_processors`) run first, on greedy and sampled rows alike. Then greedy rows
take one batched argmax; the others are scaled by their temperature, cut by min_p
(tokens below min_p times the most likely one's probability), top-k, then top-p. A seeded sequence draws its token with a generator seeded from (seed, output_index)
alone, so a request gives the same output whatever else shares its batch and
however often it is preempted and recomputed. Unseeded rows share one process
generator and are drawn together; greedy rows take one batched argmax.

A row whose processed logits leave no token (every one -inf: its grammar, allowed
tokens, min_tokens and bad words exclude each other) is never sampled: it comes back
as -1, for the caller to fail that request alone. A row that keeps some token but no
valid distribution (an infinite logit, a NaN) takes its greedy pick, as a greedy row would.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

from services.executor.logits_processors import History, apply_processors
from shared.messages import SeqSampling

GREEDY_BELOW = 1e-5  # a temperature this small means greedy


def draw_seed(seed: int, output_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed wants < 2**63 here


def cpu_kernels():
    """The C++ CPU kernels (kernels.cpu.build.load, built once per machine), or None."""
    from kernels.cpu.build import load

    return load()


def greedy_tokens(logits: Tensor, rows: list[int]) -> list[int]:
    """The argmax of these rows (the first of equal maxima), -1 for a row that is -inf throughout
    (it allows no token: the argmax's own logit tells, one gather). On the CPU the C++ kernels'
    `argmax_rows` (rows on OpenMP threads, numpy's semantics: 0.21 vs 0.58 ms for 64 rows of a 49k
    vocabulary on the AMX Xeon), else numpy's: torch's argmax over a 49k vocabulary takes ~100 us a
    row on an AVX2 CPU, numpy's ~6 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        sub = logits if len(rows) == len(logits) else logits[rows]
        values = sub.numpy()
        ext = cpu_kernels()
        if ext is not None and sub.shape[1] > 0:
            picks = torch.empty(sub.shape[0], dtype=torch.long)
            ext.argmax_rows(picks, sub.contiguous())
            picks = picks.numpy()
        else:
            picks = values.argmax(axis=-1)
        return np.where(values[np.arange(len(picks)), picks] == -np.inf, -1, picks).tolist()
    sub = logits[rows]
    picks = sub.argmax(dim=-1)
    return picks.masked_fill(sub.gather(1, picks[:, None])[:, 0] == float("-inf"), -1).tolist()


class Sampler:
    def __init__(self, seed: int | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: Tensor, params: list[SeqSampling], output_indices: list[int],
                 histories: list[History | None] | None = None) -> list[int]:
        """logits [n, vocab] float32, one row per sampled sequence; returns n token ids (-1: no
        token allowed)."""
        return self.sample(self.process(logits, params, output_indices, histories), params, output_indices)

    @staticmethod
    def process(logits: Tensor, params: list[SeqSampling], output_indices: list[int],
                histories: list[History | None] | None = None) -> Tensor:
        """The logits after every row's processors (the same tensor if none applies)."""
        return apply_processors(logits, params, output_indices, histories)

    def sample(self, logits: Tensor, params: list[SeqSampling], output_indices: list[int],
               skip: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Tokens from processed logits; -1 for the rows in skip (failed before) and the rows
        that allow no token."""
        out = [-1] * len(params)
        greedy = [i for i, p in enumerate(params) if p.temperature < GREEDY_BELOW and i not in skip]
        if greedy:
            for i, token in zip(greedy, greedy_tokens(logits, greedy), strict=True):
                out[i] = token
        rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW and i not in skip]
        if rows:
            chosen = [params[i] for i in rows]
            sub = logits[rows]
            probs = self._probabilities(sub, chosen)
            empty: list[int] = []
            # a row that keeps some token but no valid distribution (an infinite logit, a NaN)
            # takes its greedy pick, as a greedy row would; a row that keeps none is drawn from a
            # placeholder and comes back -1
            broken = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
            if bool(broken.any()):
                picks = sub[broken].argmax(dim=-1)
                empty = broken.nonzero()[:, 0][sub[broken].gather(1, picks[:, None])[:, 0] == float("-inf")].tolist()
                probs[broken] = torch.nn.functional.one_hot(picks, probs.shape[-1]).to(probs.dtype)
            drawn = self._draw(probs, chosen, [output_indices[i] for i in rows])
            for j in empty:
                drawn[j] = -1
            for i, token in zip(rows, drawn, strict=True):
                out[i] = token
        return out

    @staticmethod
    def _probabilities(logits: Tensor, params: list[SeqSampling]) -> Tensor:
        """Probabilities after temperature, then min-p, top-k and top-p cuts on the rows that ask
        for them (only those rows are sorted, so a row's numbers never depend on its batch)."""
        vocab = logits.shape[-1]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        scaled = logits / temps[:, None]
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0]
        if min_p_rows:
            rows = torch.tensor(min_p_rows, device=logits.device)
            sub = scaled[rows]
            sub_probs = sub.softmax(dim=-1)
            min_p = torch.tensor([params[i].min_p for i in min_p_rows], device=logits.device)[:, None]
            floor = sub_probs.max(dim=-1, keepdim=True).values * min_p
            scaled[rows] = sub.masked_fill(sub_probs < floor, float("-inf"))
        probs = scaled.softmax(dim=-1)
        cut_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
        if not cut_rows:
            return probs
        sorted_logits, order = scaled[cut_rows].sort(dim=-1, descending=True)
        top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in cut_rows],
                             device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in cut_rows], device=logits.device)
        rank = torch.arange(vocab, device=logits.device)
        sorted_probs = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf")).softmax(dim=-1)
        # keep a token while the mass ranked above it is still short of top_p (the first always stays)
        cut = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
        cut[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs[cut_rows] = torch.empty_like(sorted_probs).scatter_(-1, order, sorted_probs)
        return probs

    def _draw(self, probs: Tensor, params: list[SeqSampling], output_indices: list[int]) -> list[int]:
        picks = [0] * len(params)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            drawn = torch.multinomial(probs[unseeded], 1, generator=self.generator).squeeze(1).tolist()
            for i, token in zip(unseeded, drawn, strict=True):
                picks[i] = token
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(self.device).manual_seed(draw_seed(p.seed, output_indices[i]))
                picks[i] = int(torch.multinomial(probs[i], 1, generator=gen))
        return picks


def no_token_problem(p: SeqSampling, output_index: int) -> str:
    """Why a row that allows no token fails: the constraints it uses, by their API names."""
    used = [name for name, on in (
        ("structured output (response_format / structured_outputs)", p.structured is not None),
        ("allowed_token_ids", bool(p.allowed_token_ids)),
        ("min_tokens", output_index < p.min_tokens and bool(p.min_tokens_mask)),
        ("bad_words", bool(p.bad_words_ids)),
        ("logit_bias", bool(p.logit_bias)),
    ) if on]
    return (f"no token satisfies this request's constraints at output token {output_index}: "
            f"{', '.join(used) or 'its sampling settings'} exclude every token")
