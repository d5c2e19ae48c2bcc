"""Speculative decoding with a draft model (`--speculative draft --draft-model PATH`), executor side.

A smaller model with the target's vocabulary proposes k tokens for each sequence whose step asks
(`ScheduledSeq.num_proposals`), right before the step's forward pass verifies them
(`speculative`). Its KV lives in its own per-layer tensors with the target pool's block count and
block size, addressed by the same block tables and slots: the scheduler accounts for one pool, and
a slot holds the target's and the draft's K/V of the same token.

Which slots hold the draft's K/V of the token the target's holds is kept per slot (`valid`), with
that token (`tokens`). Every step's slots are written by the target, so they go stale first
(`observe`); a speculating sequence then runs one draft chunk from its first stale position to its
last real token (a catch-up: its prompt the first time, the positions of steps that did not
speculate, the token the last verification sampled), whose last row proposes d_1, then k - 1
one-token steps for d_2..d_k. Kept per slot rather than per sequence, this holds whatever the pool
does: prefix-cache hits (a block's content is its prefix's, whoever computed it), rollbacks (the
next step rewrites the rejected positions), preemption, copy-on-write copies (copied along) and
swaps (the draft's K/V is not swapped: a block that comes back is stale, its tokens come with it).

Proposals are the draft's argmax: a proposal is then a function of the context, a point mass,
which is what verification assumes (`speculative`), so greedy and sampled output keep the
target's distribution whatever the draft is; the draft only decides how much is accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.executor.batch import BatchMetadata, InvalidStep
from services.executor.kv_cache import KVCache
from services.executor.models.llama import head_dim_of
from shared.messages import ExecuteStep, ScheduledSeq


def vocabulary_problem(target_dir: str | Path, draft_dir: str | Path, target_config, draft_config) -> str | None:
    """Why the draft cannot propose for the target (another vocabulary), or None."""
    if target_config.vocab_size != draft_config.vocab_size:
        return (f"the draft model's vocabulary has {draft_config.vocab_size} tokens, the target's "
                f"{target_config.vocab_size}: a draft must share the target's tokenizer")
    vocabs = [_tokenizer_vocab(Path(d)) for d in (target_dir, draft_dir)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        ids = vocabs[0].keys() ^ vocabs[1].keys()
        differing = sorted(ids)[:3] or sorted(t for t in vocabs[0] if vocabs[0][t] != vocabs[1][t])[:3]
        return (f"the draft model's tokenizer.json maps tokens to other ids than the target's (e.g. {differing}): "
                "a draft must share the target's tokenizer")
    return None


def _tokenizer_vocab(model_dir: Path) -> dict[str, int] | None:
    """token -> id of the directory's tokenizer.json (its model's vocabulary and added tokens), if any."""
    try:
        spec = json.loads((model_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = dict((spec.get("model") or {}).get("vocab") or {})
    vocab.update((t["content"], t["id"]) for t in spec.get("added_tokens") or [])
    return vocab


class DraftProposer:
    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device,
                 num_host_blocks: int):
        config = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = KVCache(config.num_hidden_layers, num_blocks, block_size, model.num_local_kv_heads,
                          head_dim_of(config), kv_dtype, device)
        self.device = device
        slots = num_blocks * block_size
        self.tokens = torch.full((slots,), -1, dtype=torch.long)  # the token whose target K/V each slot holds
        self.valid = torch.zeros(slots, dtype=torch.bool)  # ... and whether the draft's K/V there is its
        self.host_tokens = torch.full((num_host_blocks, block_size), -1, dtype=torch.long)

    def move_blocks(self, step: ExecuteStep, copy_blocks) -> None:
        """Follow the step's block moves (done on the target's pool already): swaps carry the tokens
        only, copy-on-write copies the draft's K/V too (copy_blocks: the attention backend's)."""
        bs = self.block_size
        tokens = self.tokens.view(-1, bs)
        valid = self.valid.view(-1, bs)
        for dev, host in step.swap_out:
            self.host_tokens[host] = tokens[dev]
        for host, dev in step.swap_in:
            tokens[dev] = self.host_tokens[host]
            valid[dev] = False
        if step.block_copies:
            copy_blocks(self.kv.k_caches, self.kv.v_caches, step.block_copies)
            for src, dst in step.block_copies:
                tokens[dst] = tokens[src]
                valid[dst] = valid[src]

    def observe(self, step: ExecuteStep) -> None:
        """The step's real tokens are about to be written into their slots by the target."""
        slots = [slot for s in step.seqs for slot in s.slot_mapping[: len(s.token_ids)]]
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long)
        if int(index.min()) < 0 or int(index.max()) >= self.tokens.numel():
            raise InvalidStep(f"a slot outside the pool of {self.num_blocks} blocks")
        self.tokens[index] = torch.tensor([t for s in step.seqs for t in s.token_ids], dtype=torch.long)
        self.valid[index] = False

    @torch.inference_mode()
    def propose(self, step: ExecuteStep) -> None:
        """Fill in the proposals of the step's sequences that ask for them: their draft_token_ids,
        also appended to their token_ids (after `observe`, before the step's metadata is built)."""
        seqs = [s for s in step.seqs if s.num_proposals]
        if not seqs:
            return
        bs = self.block_size
        chunks = []
        for s in seqs:
            n, k = len(s.token_ids), s.num_proposals
            if s.draft_token_ids or not s.sample or len(s.slot_mapping) != n + k:
                raise InvalidStep(f"{s.request_id}: {k} proposals asked with {len(s.slot_mapping)} slots for "
                                  f"{n} tokens")
            last = s.start_pos + n - 1  # the position of its last real token
            if len(s.block_table) * bs < last + k + 1:
                raise InvalidStep(f"{s.request_id}: {len(s.block_table)} blocks cannot hold {last + k + 1} tokens")
            table = torch.tensor(s.block_table, dtype=torch.long)
            pos = torch.arange(last + 1)
            slots = table[pos // bs] * bs + pos % bs
            stale = (~self.valid[slots]).nonzero()
            first = int(stale[0]) if len(stale) else last
            tokens = self.tokens[slots[first:]]
            if bool((tokens < 0).any()):
                raise InvalidStep(f"{s.request_id}: the pool holds no token for some of its positions")
            chunks.append(ScheduledSeq(s.request_id, tokens.tolist(), first, s.block_table, slots[first:].tolist(),
                                       True, 0))
            self.valid[slots[first:]] = True
        proposals = [[t] for t in self._argmax(chunks)]
        for j in range(1, max(s.num_proposals for s in seqs)):
            going = [i for i, s in enumerate(seqs) if s.num_proposals > j]
            steps = []
            for i in going:
                s = seqs[i]
                slot = s.slot_mapping[len(s.token_ids) - 1 + j]
                steps.append(ScheduledSeq(s.request_id, [proposals[i][-1]], s.start_pos + len(s.token_ids) - 1 + j,
                                          s.block_table, [slot], True, 0))
                self.valid[slot] = True
            for i, t in zip(going, self._argmax(steps), strict=True):
                proposals[i].append(t)
        for s, draft in zip(seqs, proposals, strict=True):
            n = len(s.token_ids)
            self.tokens[torch.tensor(s.slot_mapping[n:], dtype=torch.long)] = torch.tensor(draft, dtype=torch.long)
            self.valid[s.slot_mapping[-1]] = False  # the last proposal's K/V is the target's alone
            s.draft_token_ids = draft
            s.token_ids = s.token_ids + draft

    def _argmax(self, seqs: list[ScheduledSeq]) -> list[int]:
        """The draft's greedy next token of each sequence, its chunk's K/V written to the draft's pool."""
        meta = BatchMetadata.from_step(ExecuteStep(-1, seqs), self.block_size, self.num_blocks, self.device)
        logits = self.model(meta, self.kv.k_caches, self.kv.v_caches)
        return logits.argmax(dim=-1).tolist()
