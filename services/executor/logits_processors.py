"""The logits processors of one step, batched: each is a few tensor ops over the rows that use it.

Applied in this order, before temperature (as vLLM does):
1. `allowed_token_ids`: every other token is masked (-inf);
2. `min_tokens`: while a row has produced fewer tokens, its EOS and stop token ids are masked;
3. `bad_words` (as transformers' `NoBadWordsLogitsProcessor`): a word's last token is masked
   when the output ends with the rest of it (a one-token word always);
4. `logit_bias`: added to the logits of the tokens named;
5. `repetition_penalty` r (transformers' `RepetitionPenaltyLogitsProcessor`, vLLM's): the
   logit of every token seen in the prompt or the output is divided by r when positive,
   multiplied by r when negative;
6. `frequency_penalty` f and `presence_penalty` p (OpenAI's): logit -= f * count + p * (count > 0),
   counting the tokens generated so far only.

A row's history (its prompt and output token ids) is turned into counts with one
scatter over a padded [rows, length] tensor; nothing loops over the vocabulary in
Python. The tensors made from a request's long lists (an `allowed_token_ids` mask over the
vocabulary, `logit_bias` as index and value tensors) are built once per list and kept
(`_derived`, keyed by the list object, which the executor's sequence states keep and share
between a request's samples): a request of 256 samples that each allow the whole vocabulary
would otherwise cost seconds of Python per step, for everyone in the batch. Rows that use no processor are untouched, and a step where no row uses one
returns the logits as they came (no copy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from shared.messages import SeqSampling


class History:
    """The tokens a row's penalties read."""

    __slots__ = ("output_token_ids", "prompt_token_ids")

    def __init__(self, prompt_token_ids: Sequence[int] = (), output_token_ids: Sequence[int] = ()):
        self.prompt_token_ids, self.output_token_ids = prompt_token_ids, output_token_ids


def _uses_any(p: SeqSampling, output_index: int) -> bool:
    return bool(p.allowed_token_ids or p.logit_bias or p.needs_history or p.bad_words_ids
                or (output_index < p.min_tokens and p.min_tokens_mask))


def _counts(rows: list[Sequence[int]], vocab: int, device) -> Tensor:
    """[len(rows), vocab] float counts of each token id in each row (ids outside the vocabulary
    are dropped)."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.full((len(rows), width + 1), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            padded[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    padded = padded.clamp_(0, vocab).to(device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


class _Derived:
    """Tensors made from a sampling list, by the list's identity (held here so the id stays
    its own), least recently used dropped past MAX_DERIVED."""

    MAX_DERIVED = 512

    def __init__(self):
        self._entries: OrderedDict[tuple, tuple[object, object]] = OrderedDict()

    def get(self, kind: str, values: list, vocab: int, device, build):
        key = (kind, id(values), vocab, str(device))
        hit = self._entries.get(key)
        if hit is not None and hit[0] is values:
            self._entries.move_to_end(key)
            return hit[1]
        made = build(values, vocab, device)
        self._entries[key] = (values, made)
        while len(self._entries) > self.MAX_DERIVED:
            self._entries.popitem(last=False)
        return made


_derived = _Derived()


def _allowed_mask(tokens: list[int], vocab: int, device) -> Tensor:
    keep = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.long, device=device)
    keep[ids] = True
    return keep


def _bias_tensors(pairs: list[tuple[int, float]], vocab: int, device) -> tuple[Tensor, Tensor]:
    kept = [(t, b) for t, b in pairs if 0 <= t < vocab]
    return (torch.tensor([t for t, _ in kept], dtype=torch.long, device=device),
            torch.tensor([b for _, b in kept], dtype=torch.float32, device=device))


def _flat(pairs: list[tuple[int, int]], vocab: int, device) -> tuple[Tensor, Tensor]:
    kept = [(r, t) for r, t in pairs if 0 <= t < vocab]
    rows = torch.tensor([r for r, _ in kept], dtype=torch.long, device=device)
    toks = torch.tensor([t for _, t in kept], dtype=torch.long, device=device)
    return rows, toks


def _ends_with(histories, row: int, prefix: list[int]) -> bool:
    if not prefix:
        return True
    if histories is None or histories[row] is None:
        raise ValueError("a row with multi-token bad words has no token history")
    out = histories[row].output_token_ids
    return len(out) >= len(prefix) and list(out[len(out) - len(prefix):]) == list(prefix)


def apply_processors(logits: Tensor, params: Sequence[SeqSampling], output_indices: Sequence[int],
                     histories: Sequence[History | None] | None = None) -> Tensor:
    """logits [rows, vocab] float32 with each row's processors applied (a new tensor, or the
    same one when no row uses any)."""
    if not any(_uses_any(p, i) for p, i in zip(params, output_indices, strict=True)):
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    ninf = float("-inf")

    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allowed:
        keep = torch.stack([_derived.get("allowed", params[i].allowed_token_ids, vocab, device, _allowed_mask)
                            for i in allowed])
        rows = torch.tensor(allowed, device=device)
        logits[rows] = logits[rows].masked_fill(~keep, ninf)

    masked = [(i, tok) for i, (p, n) in enumerate(zip(params, output_indices, strict=True)) if n < p.min_tokens
              for tok in p.min_tokens_mask]
    if masked:
        r, t = _flat(masked, vocab, device)
        logits[r, t] = ninf

    banned = [(i, word[-1]) for i, p in enumerate(params) for word in p.bad_words_ids
              if word and _ends_with(histories, i, word[:-1])]
    if banned:
        r, t = _flat(banned, vocab, device)
        logits[r, t] = ninf

    biased = [(i, _derived.get("bias", p.logit_bias, vocab, device, _bias_tensors))
              for i, p in enumerate(params) if p.logit_bias]
    if biased:
        r = torch.cat([torch.full((len(t),), i, dtype=torch.long, device=device) for i, (t, _) in biased])
        t = torch.cat([t for _, (t, _) in biased])
        bias = torch.cat([b for _, (_, b) in biased]).to(logits.dtype)
        logits.index_put_((r, t), bias, accumulate=True)

    penalized = [i for i, p in enumerate(params) if p.needs_history]
    if penalized:
        if histories is None or any(histories[i] is None for i in penalized):
            raise ValueError("a penalized row has no token history")
        rows = torch.tensor(penalized, device=device)
        sub = logits[rows]
        out_counts = _counts([histories[i].output_token_ids for i in penalized], vocab, device)
        rep = torch.tensor([params[i].repetition_penalty for i in penalized], device=device)[:, None]
        if (rep != 1).any():
            seen = (out_counts > 0) | (_counts([histories[i].prompt_token_ids for i in penalized], vocab, device) > 0)
            sub = torch.where(seen & (rep != 1), torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = torch.tensor([params[i].frequency_penalty for i in penalized], device=device)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in penalized], device=device)[:, None]
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
        logits[rows] = sub
    return logits
