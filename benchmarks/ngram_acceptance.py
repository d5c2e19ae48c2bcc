"""Tokens per verification step of prompt-lookup proposer designs, replayed exactly offline.

    python -m benchmarks.greedy_outputs            # once: SmolLM2's greedy outputs on both sets
    python -m benchmarks.ngram_acceptance [--outputs PATH] [--output-len 128] [--cost 1 1.02 ...]

Greedy speculation is lossless, so a request's output is fixed; what a proposer changes is how
many steps produce it. This replays each saved output as the engine decodes it: the prefill
step gives output token 0, then each verification step shows the proposer prompt + output so
far, takes its draft (no more than the tokens left to max_tokens, less one, as `Speculator`
caps it), accepts the longest prefix equal to the true continuation and adds the bonus token.
Per variant and set: tokens per step, the share of proposed tokens accepted, steps per request
and, with a cost table (`--cost`: step time of 1 + k tokens over a 1-token step, for k = 0..;
`benchmarks.verify_cost` measures it), the expected TPOT over plain decoding's: the summed
cost of the steps divided by the tokens they made. No clock is read: the figures are exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.greedy_outputs import DEFAULT_OUT
from services.scheduler.ngram_proposer import propose_ngram

# step(1 + k tokens) / step(1 token), k = 0..8: SmolLM2 at C=1, int4 copies on every step (wall p50 ratios
# of benchmarks.verify_cost on the 2-core host)
DEFAULT_COST = (1.0, 1.20, 1.32, 1.49, 1.62, 1.70, 1.80, 1.87, 2.01)


def match_length(history: np.ndarray, end: int, limit: int) -> int:
    """How many tokens before history[end] equal the last tokens of history (at most limit)."""
    n = 0
    last = len(history) - 1
    while n < limit and end - 1 - n >= 0 and history[end - 1 - n] == history[last - n] and end - 1 - n < last - n:
        n += 1
    return n


def candidates(tokens: list[int], min_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(history, the positions following each earlier occurrence of the last min_n tokens)."""
    history = np.asarray(tokens, dtype=np.int64)
    if len(tokens) < min_n + 1:
        return history, np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(history[:-1], min_n)
    hits = np.flatnonzero((windows == history[-min_n:]).all(axis=1))
    return history, hits + min_n


@dataclass
class Proposer:
    """One design: which occurrence proposes, and how many tokens it may."""

    name: str
    k: int = 4
    min_n: int = 1
    max_n: int = 4
    select: str = "latest"  # "latest" of the longest matches, or "prompt": the prompt's first
    k_of_match: Callable[[int, int], int] | None = None  # (match length, k) -> tokens to propose
    adaptive: bool = False  # k doubles after a fully accepted draft, drops to accepted + 1 after a miss
    pointer: bool = False  # while the last draft was taken whole, keep copying from where it came
    chain: bool = False  # draft token by token: each the most frequent follower of the longest suffix
    stop_below: int = 0  # chain: stop drafting where the longest matched suffix is shorter than this ...
    stop_share: float = 1.0  # ... and its most frequent follower has less than this share of its occurrences
    corpus: list[int] | None = None  # earlier requests' outputs, as a cache across requests (llama.cpp's
    # ngram-cache keeps one): a longer match there than in the sequence's own tokens proposes
    state: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.state = {"k": self.k, "src": None}

    def propose(self, tokens: list[int], prompt_len: int, room: int) -> list[int]:
        k = min(room, self.state["k"] if self.adaptive else self.k)
        if k <= 0:
            return []
        if self.chain:
            return self.propose_chain(tokens, k)
        src = self.state["src"]
        if self.pointer and src is not None and src < len(tokens) - 1:
            self.state["from"] = src
            return tokens[src : src + k]
        history, follow = candidates(tokens, self.min_n)
        if self.corpus is not None:
            found = self.corpus_match(tokens, k, min(follow.size and max(
                match_length(history, int(f), self.max_n) for f in follow), self.max_n))
            if found:
                return found
        if not follow.size:
            return []
        lengths = [match_length(history, int(f), self.max_n) for f in follow]
        best = max(lengths)
        if best < self.min_n:
            return []
        chosen = [int(f) for f, n in zip(follow, lengths, strict=True) if n == best]
        start = chosen[-1]
        if self.select == "prompt":
            in_prompt = [f for f in chosen if f < prompt_len]
            start = in_prompt[-1] if in_prompt else start
        if self.k_of_match is not None:
            k = min(k, self.k_of_match(best, self.k))
        self.state["from"] = start
        return tokens[start : start + k]

    def corpus_match(self, tokens: list[int], k: int, own: int) -> list[int]:
        """What followed the latest occurrence, in earlier requests' outputs, of a suffix longer
        than the sequence's own longest match (and at least 2 tokens), or []."""
        corpus = np.asarray(self.corpus, dtype=np.int64)
        tail = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens), len(corpus) - 1), max(own, 1), -1):
            windows = np.lib.stride_tricks.sliding_window_view(corpus[:-1], n)
            hits = np.flatnonzero((windows == tail[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                self.state["from"] = None
                return self.corpus[start : start + (min(k, self.k_of_match(n, self.k)) if self.k_of_match else k)]
        return []

    def propose_chain(self, tokens: list[int], k: int) -> list[int]:
        ext = list(tokens)
        draft: list[int] = []
        while len(draft) < k:
            history = np.asarray(ext, dtype=np.int64)
            for n in range(min(self.max_n, len(ext) - 1), self.min_n - 1, -1):
                windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
                hits = np.flatnonzero((windows == history[-n:]).all(axis=1))
                if hits.size:
                    break
            else:
                return draft
            followers = history[hits + n]
            values, counts = np.unique(followers, return_counts=True)
            top = counts.max()
            best = set(values[counts == top].tolist())
            tok = next(int(f) for f in followers[::-1] if f in best)  # the latest of the most frequent
            if n < self.stop_below and top / hits.size < self.stop_share:
                return draft
            draft.append(tok)
            ext.append(tok)
        return draft

    def observe(self, proposed: int, accepted: int, bonus_continues: bool) -> None:
        if self.adaptive and proposed:
            self.state["k"] = min(self.k, 2 * self.state["k"]) if accepted == proposed else max(1, accepted + 1)
        if self.pointer:
            taken = proposed and accepted == proposed and bonus_continues
            self.state["src"] = self.state["from"] + proposed + 1 if taken else None


@dataclass
class Tally:
    steps: int = 0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    cost: float = 0.0
    requests: int = 0


def replay(proposer: Proposer, prompt: list[int], output: list[int], cost: tuple[float, ...], tally: Tally) -> None:
    proposer.reset()
    tally.requests += 1
    pos = 1  # the prefill step made output[0]
    while pos < len(output):
        tokens = prompt + output[:pos]
        draft = proposer.propose(tokens, len(prompt), len(output) - pos - 1)
        draft = draft[: min(len(draft), len(cost) - 1)]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[pos + accepted]:
            accepted += 1
        nxt = pos + accepted
        src = proposer.state.get("from")
        continues = bool(draft) and src is not None and src + len(draft) < len(tokens) and \
            tokens[src + len(draft)] == output[nxt] if accepted == len(draft) else False
        proposer.observe(len(draft), accepted, continues)
        tally.steps += 1
        tally.tokens += accepted + 1
        tally.proposed += len(draft)
        tally.accepted += accepted
        tally.cost += cost[len(draft)]
        pos = nxt + 1
    if proposer.corpus is not None:
        proposer.corpus.extend(output)


def variants() -> list[Proposer]:
    def scaled(n: int, k: int) -> int:
        return n

    out = [Proposer("old default: n 1-4, k 4")]
    out += [Proposer(f"n 1-4, k {k}", k=k) for k in (2, 3, 5, 6, 8)]
    out += [Proposer(f"n {lo}-{hi}, k 4", min_n=lo, max_n=hi) for lo, hi in ((2, 4), (3, 4), (1, 16), (2, 16))]
    out += [Proposer("n 1-4, k 4, prefer prompt", select="prompt"),
            Proposer("n 1-16, k 8, prefer prompt", k=8, max_n=16, select="prompt")]
    out += [Proposer("n 1-16, k 8, k = 2 x match length", k=8, max_n=16, k_of_match=lambda n, k: 2 * n),
            Proposer("n 1-16, k 8, k = match - 1", k=8, max_n=16, k_of_match=lambda n, k: n - 1),
            Proposer("n 1-16, k 8, 1 if match 1 else 8", k=8, max_n=16, k_of_match=lambda n, k: 1 if n < 2 else k),
            Proposer("n 1-16, k 8, 2 if match < 3 else 8", k=8, max_n=16, k_of_match=lambda n, k: 2 if n < 3 else k),
            Proposer("n 1-8, k 4, k = match length", max_n=8, k_of_match=scaled),
            Proposer("n 1-8, k 8, k = match length", k=8, max_n=8, k_of_match=scaled)]
    out += [Proposer(f"n 2-8, k {k}, k = match length" + (" (new default)" if k == 3 else ""), k=k, min_n=2,
                     max_n=8, k_of_match=scaled) for k in (3, 4, 6, 8)]
    out += [Proposer("n 1-4, k 8, adaptive", k=8, adaptive=True),
            Proposer("n 1-16, k 8, adaptive", k=8, max_n=16, adaptive=True),
            Proposer("n 1-4, k 4, suffix pointer", pointer=True),
            Proposer("n 1-16, k 8, suffix pointer", k=8, max_n=16, pointer=True),
            Proposer("n 1-16, k 8, pointer + adaptive", k=8, max_n=16, pointer=True, adaptive=True)]
    out += [Proposer("chain n 1-4, k 4", chain=True),
            Proposer("chain n 1-8, k 8", k=8, max_n=8, chain=True),
            Proposer("chain n 1-8, k 8, stop n<2 & share<1", k=8, max_n=8, chain=True, stop_below=2),
            Proposer("chain n 1-8, k 8, stop n<3 & share<.6", k=8, max_n=8, chain=True, stop_below=3,
                     stop_share=0.6),
            Proposer("chain n 2-8, k 8", k=8, min_n=2, max_n=8, chain=True)]
    out += [Proposer("n 1-8, k 4, + earlier outputs", max_n=8, corpus=[]),
            Proposer("n 1-8, k 8, + earlier outputs", k=8, max_n=8, corpus=[]),
            Proposer("n 2-8, k 8, k = match length, + earlier outputs", k=8, min_n=2, max_n=8, k_of_match=scaled,
                     corpus=[])]
    return out


def check_engine(data: dict, output_len: int) -> None:
    """The simulator's designs that the engine offers are its propose_ngram, draft for draft:
    the old default and the new one (`SpeculativeConfig`'s)."""
    for sim, n_range, per_match in ((Proposer("old"), (1, 4), 0),
                                    (Proposer("new", min_n=2, max_n=8, k_of_match=lambda n, k: n), (2, 8), 1)):
        sim.reset()
        for req in data["copy"][:2]:
            prompt, output = req["prompt"], req["output"][:output_len]
            for pos in range(1, len(output)):
                tokens = prompt + output[:pos]
                assert sim.propose(tokens, len(prompt), 4) == propose_ngram(tokens, 4, *n_range, per_match), pos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cost", type=float, nargs="+", default=list(DEFAULT_COST))
    args = parser.parse_args(argv)
    data = json.loads(args.outputs.read_text())
    cost = tuple(args.cost)
    check_engine(data, args.output_len)
    print(f"{args.output_len} output tokens; cost(k) = {', '.join(f'{c:.2f}' for c in cost)}")
    print(f"| variant | {' | '.join(f'{s}: tok/step, accept %, steps/req, TPOT ratio' for s in data)} |")
    print("|---|" + "---|" * len(data))
    for proposer in variants():
        cells = []
        for requests in data.values():
            if proposer.corpus is not None:
                proposer.corpus = []
            t = Tally()
            for req in requests:
                replay(proposer, req["prompt"], req["output"][: args.output_len], cost, t)
            rate = 100 * t.accepted / t.proposed if t.proposed else 0.0
            cells.append(f"{t.tokens / t.steps:.2f}, {rate:.0f}%, {t.steps / t.requests:.1f}, {t.cost / t.tokens:.2f}")
        print(f"| {proposer.name} | {' | '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
