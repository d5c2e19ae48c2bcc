"""The deepseek_r1 reasoning parser (services/gateway/reasoning.py): any split of a text into
deltas gives what the whole text gives, and no part of a marker is ever emitted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.gateway.reasoning import ThinkParser, split_reasoning


def _fed(parts: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ThinkParser()
    outs = [parser.feed(p) for p in parts] + [parser.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs), outs


def test_thinking_is_split_off_the_answer():
    assert split_reasoning("deepseek_r1", "<think>hmm, 2+2</think>\n\n4") == ("hmm, 2+2", "\n\n4")
    # the chat template opened the thinking: no <think> in the output
    assert split_reasoning("deepseek_r1", "hmm</think>4") == ("hmm", "4")
    # no </think>: all of it is reasoning (the model never finished thinking)
    assert split_reasoning("deepseek_r1", "<think>still going") == ("still going", "")
    # only the first </think> ends it; a later <think> is content
    assert split_reasoning("deepseek_r1", "a</think>b<think>c</think>d") == ("a", "b<think>c</think>d")
    # a marker's start that never completes is plain text
    assert split_reasoning("deepseek_r1", "x </thi") == ("x </thi", "")


def test_a_marker_split_across_deltas_is_held_until_whole():
    assert _fed(["<thi", "nk>hm", "m</", "think", ">4"])[2] == [("", ""), ("hm", ""), ("m", ""), ("", ""),
                                                               ("", "4"), ("", "")]


_ALPHABET = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "t", "/", "a", " ", "\n", "é"])


@given(st.lists(_ALPHABET, max_size=30).map("".join), st.data())
def test_any_split_into_deltas_gives_what_the_whole_text_gives(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasoning, content, outs = _fed(parts)
    assert (reasoning, content) == split_reasoning("deepseek_r1", text)
    assert "</think>" not in reasoning
    if "</think>" in text:  # everything after the first end marker is content, as it came
        assert content == text.split("</think>", 1)[1]


@given(st.text(st.sampled_from("<>/thinkab"), max_size=40))
def test_one_character_at_a_time_gives_what_the_whole_text_gives(text):
    reasoning, content, _ = _fed(list(text))
    assert (reasoning, content) == split_reasoning("deepseek_r1", text)
