"""OpenAI response bodies of one request: the whole object, or its stream of chunks (and the
last usage chunk), from the TextDeltas the engine sends; logprobs in the endpoint's shape
(logprobs.py) and tool calls parsed from the answer (tools.py)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.gateway.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from services.gateway.openai.tools import ToolMode, extract_calls, extract_calls_off_loop, render_calls
from services.gateway.reasoning import ThinkParser, make_parser
from shared.messages import SamplingParams, TokenLogprob, ToolCall


def new_request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class ChoiceState:
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # whole responses: every token's
    text_offset: int = 0  # streamed completions: where the next token's text starts
    prompt_text: str | None = None  # echo
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    started: bool = False  # its first chunk went out (a stream echoes the prompt there)
    held: str = ""  # a stream with tools: the text so far, sent (as calls or text) at the end
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    reasoning: ThinkParser | None = None  # a chat choice's, with a reasoning parser
    reasoning_text: str = ""  # all of it so far (a whole response shows it)


class ResponseBuilder:
    """The bodies of one request's answer: the whole object, or its stream of chunks.

    With return_token_ids, each choice also lists its generated token ids (in a stream,
    the ones new in that chunk). With logprobs (params.logprobs set), each choice, or each
    chunk, has them in the endpoint's shape (see logprobs.py); with echo, a completion's
    text (and logprobs) starts with the prompt's; echo_only drops the one token the engine
    ran to score the prompt. Choices of a batch of prompts are numbered prompt * n + sample.
    """

    def __init__(
        self, kind: str, request_id: str, model: str, include_usage: bool = False, return_token_ids: bool = False,
        num_choices: int = 1, params: SamplingParams | None = None, echo_only: bool = False,
        tool_mode: ToolMode | None = None, reasoning_parser: str | None = None, include_reasoning: bool = True,
    ):
        self.kind, self.id, self.model = kind, request_id, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.created = int(time.time())
        self.choices = [ChoiceState() for _ in range(num_choices)]
        params = params or SamplingParams()
        self.logprobs = params.logprobs is not None
        self.prompt_logprobs = params.prompt_logprobs is not None and not (params.echo and self.logprobs)
        self.echo, self.echo_only = params.echo, echo_only
        self.n = params.n if num_choices % params.n == 0 else 1
        # with tools (other than tool_choice none) a choice's text is parsed for calls when it ends
        self.tool_mode = tool_mode if tool_mode is not None and tool_mode.choice != "none" else None
        self._calls: dict[int, tuple[str | None, list[ToolCall]]] = {}  # by choice, parsed ahead off the loop
        self.reasoning = reasoning_parser is not None and kind == "chat"
        self.include_reasoning = include_reasoning
        if self.reasoning:
            for c in self.choices:
                c.reasoning = make_parser(reasoning_parser)

    def split(self, msg) -> tuple[str, str]:
        """A TextDelta's (reasoning, content): all content without a reasoning parser. Call once
        per delta, in order: the content is what tool calls and the answer are made of."""
        state = self.choices[msg.seq_index]
        if state.reasoning is None:
            return "", msg.text
        reasoning, content = state.reasoning.feed(msg.text)
        if msg.finish_reason is not None:
            more_reasoning, more_content = state.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if not self.include_reasoning:
            return "", content
        state.reasoning_text += reasoning
        return reasoning, content

    async def parse_calls(self, index: int, text: str) -> None:
        """Find a finished choice's tool calls ahead of full() or its last chunk(), off the event
        loop when the text is long; text is the whole answer (a stream: what is held plus the last delta)."""
        if self.tool_mode is not None:
            self._calls[index] = await extract_calls_off_loop(self.tool_mode, text)

    def _extract_calls(self, index: int, text: str) -> tuple[str | None, list[ToolCall]]:
        found = self._calls.pop(index, None)
        return found if found is not None else extract_calls(self.tool_mode, text)

    def record(self, msg) -> bool:
        """Note a TextDelta's counts; True once every choice has finished."""
        choice = self.choices[msg.seq_index]
        choice.num_output_tokens = 0 if self.echo_only else msg.num_output_tokens
        choice.num_prompt_tokens = msg.num_prompt_tokens
        choice.num_cached_tokens = max(choice.num_cached_tokens, msg.num_cached_tokens)
        if msg.finish_reason is not None:
            choice.finish_reason = msg.finish_reason
            choice.stop_reason = msg.stop_reason
        if msg.prompt_text is not None:
            choice.prompt_text = msg.prompt_text
        if msg.prompt_logprobs:  # sent on one delta of a prompt's n: each of its choices has them
            base = msg.seq_index - msg.seq_index % self.n
            for sibling in self.choices[base : base + self.n]:
                sibling.prompt_logprobs = msg.prompt_logprobs
        if self.logprobs and not self.echo_only:
            choice.logprobs += msg.logprobs
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def usage(self) -> dict:
        """Prompt tokens count once per prompt (its n choices share it)."""
        firsts = self.choices[:: self.n]
        out = usage(sum(c.num_prompt_tokens for c in firsts), self.num_output_tokens)
        out["prompt_tokens_details"] = {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}
        return out

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _finish(self, choice: dict, finish_reason: str | None, token_ids: list[int], state: ChoiceState | None = None,
                logprobs: dict | None = None) -> dict:
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        if finish_reason is not None:
            choice["stop_reason"] = state.stop_reason if state is not None else None
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _echo_entries(self, state: ChoiceState) -> list[TokenLogprob]:
        return state.prompt_logprobs if self.echo and self.logprobs else []

    def _logprobs(self, state: ChoiceState, entries: list[TokenLogprob], first: bool) -> dict | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        if first:
            entries = self._echo_entries(state) + entries
        out, state.text_offset = completion_logprobs(entries, state.text_offset)
        return out

    def full(self, choices: list[tuple[str, str | None, list[int]]], usage_: dict) -> dict:
        """choices: (text, finish_reason, token_ids) by choice index."""
        out = []
        for index, (text, finish_reason, token_ids) in enumerate(choices):
            state = self.choices[index] if index < len(self.choices) else ChoiceState()
            if self.echo_only:
                text, token_ids, finish_reason = "", [], "length"
            if self.kind == "chat":
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
                if self.tool_mode is not None:
                    content, calls = self._extract_calls(index, text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content,
                                             "tool_calls": render_calls(calls)}
                        finish_reason = self._tool_finish(finish_reason)
                if self.reasoning and self.include_reasoning:
                    choice["message"]["reasoning_content"] = state.reasoning_text or None
            else:
                choice = {"index": index, "text": (state.prompt_text or "") + text if self.echo else text}
            state.text_offset = 0
            self._finish(choice, finish_reason, list(token_ids), state, self._logprobs(state, state.logprobs, True))
            if self.prompt_logprobs and self.kind != "chat":
                choice["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs)
            out.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        body = {**self._envelope(obj, out), "usage": usage_}
        if self.prompt_logprobs and self.kind == "chat":
            body["prompt_logprobs"] = prompt_logprobs(self.choices[0].prompt_logprobs)
        return body

    def chunk(
        self, text: str, finish_reason: str | None = None, role: bool = False, token_ids: list[int] = (),
        index: int = 0, logprobs: list[TokenLogprob] = (), reasoning: str = "",
    ) -> dict | None:
        """One SSE chunk, or None while a choice with tools holds its text back (and has no
        reasoning to show). text is the content (split() took any reasoning off)."""
        state = self.choices[index] if index < len(self.choices) else ChoiceState()
        first = not state.started and not role
        if not role:
            state.started = True
        if self.echo_only:
            text, token_ids, logprobs = "", [], []
            finish_reason = "length" if finish_reason is not None else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            if self.tool_mode is not None and not role:
                state.held += text
                if finish_reason is None:
                    delta = {}
                    if not reasoning:
                        return None  # held until the end: calls or text
                else:
                    content, calls = self._extract_calls(index, state.held)
                    delta = {"content": content} if content else {}
                    if calls:
                        delta["tool_calls"] = render_calls(calls, stream=True)
                        finish_reason = self._tool_finish(finish_reason)
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice, obj = {"index": index, "delta": delta}, "chat.completion.chunk"
        else:
            if first and self.echo:
                text = (state.prompt_text or "") + text
            choice, obj = {"index": index, "text": text}, "text_completion"
        lp = None if role else self._logprobs(state, list(logprobs), first)
        self._finish(choice, finish_reason, list(token_ids), state, lp)
        if first and self.prompt_logprobs and self.kind != "chat":
            choice["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs)
        out = self._envelope(obj, [choice])
        if first and self.prompt_logprobs and self.kind == "chat" and index == 0:
            out["prompt_logprobs"] = prompt_logprobs(state.prompt_logprobs)
        if self.include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def _tool_finish(finish_reason: str | None) -> str | None:
        """Calls end a choice with "tool_calls", unless max_tokens cut it short."""
        return "tool_calls" if finish_reason == "stop" else finish_reason

    def usage_chunk(self, usage_: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_}
