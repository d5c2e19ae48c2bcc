"""Turn a GenerateRequest into prompt token ids, or a 400 that says what is wrong.

Chat messages go through the model's chat template (with the assistant turn opened,
unless add_generation_prompt is false or continue_final_message leaves the last
assistant message open; chat_template_kwargs are the template's variables), with no
special tokens added beyond the template's; a text prompt is tokenized as the tokenizer
does by default (add_special_tokens true); token ids are checked
against the vocabulary. Every prompt must leave room for max_tokens in the context;
a request without max_tokens (None) gets the rest of the context (`resolve_max_tokens`).
Structured output specs are compiled by the stage's grammar pool, not here.
"""

from __future__ import annotations

import msgspec
from jinja2 import TemplateError

from services.tokenizer.tool_prompt import conversation, template_knows_tools
from shared.messages import (
    ChatMessage,
    ChatOptions,
    GenerateRequest,
    SamplingParams,
    TokenizeRequest,
)


class PromptError(ValueError):
    """The request cannot be served as asked: becomes a RequestError 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptBuilder:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, req: GenerateRequest | TokenizeRequest) -> tuple[list[int], str]:
        """(token ids, "prompt" or "messages"), unchecked for length."""
        if req.messages is not None:
            return self._chat(req.messages, req.chat or ChatOptions(), req.add_special_tokens), "messages"
        if getattr(req, "prompt_token_ids", None) is not None:
            return self.check_ids(req.prompt_token_ids), "prompt"
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            return self.tokenizer.encode(req.prompt, add_special_tokens=add), "prompt"
        raise PromptError("The request has no prompt and no messages.", "prompt")

    def build(self, req: GenerateRequest) -> list[int]:
        ids, what = self.tokenize(req)
        if not ids:
            raise PromptError(f"The {what} is empty: at least one token is needed.", what)
        self._check_length(len(ids), req.params.max_tokens, what)
        self._check_param_ids(req.params)
        return ids

    def _check_param_ids(self, params: SamplingParams) -> None:
        """Token ids in sampling fields must be in the vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids)):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise PromptError(f"'{name}' holds token id {bad}, outside the vocabulary [0, {self.vocab_size}).",
                                  name)

    def _chat(self, messages: list[ChatMessage], chat: ChatOptions, add_special_tokens: bool | None) -> list[int]:
        if not messages:
            raise PromptError("messages must hold at least one message.", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("This model has no chat template: use /v1/completions.", "messages")
        if chat.continue_final_message and messages[-1].role != "assistant":
            raise PromptError("continue_final_message needs the last message to be the assistant's.", "messages")
        conv, tools = conversation(messages, chat.tools, template_knows_tools(self.tokenizer))
        extra = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                conv,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tokenize=False,
                **extra,
                **chat.template_kwargs,
            )
        except (TemplateError, ValueError, TypeError) as exc:  # templates raise on conversations they reject
            raise PromptError(f"The chat template rejected the messages: {exc}", "messages") from exc
        # The template already writes every special token the model expects.
        return self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))

    def check_ids(self, ids: list[int]) -> list[int]:
        for tok in ids:
            if not 0 <= tok < self.vocab_size:
                raise PromptError(
                    f"Token id {tok} is out of vocabulary: ids must be in [0, {self.vocab_size}).", "prompt"
                )
        return list(ids)

    def resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """params with max_tokens set (None becomes the rest of the context) and bad_words as
        token ids."""
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=self.max_model_len - prompt_len)
        if params.bad_words and not params.bad_words_ids:
            params = msgspec.structs.replace(params, bad_words_ids=self.bad_words_ids(params.bad_words))
        return params

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, as written and after a space (as vLLM: a word mid-text usually
        follows one)."""
        out = set()
        for word in words:
            for prefix in ("", " "):
                ids = self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if ids:
                    out.add(tuple(ids))
        return [list(ids) for ids in sorted(out)]

    def _check_length(self, prompt_len: int, max_tokens: int | None, what: str) -> None:
        if max_tokens is None and prompt_len >= self.max_model_len:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the {what} "
                f"alone has {prompt_len}: no room is left for the completion.", what,
            )
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} "
                f"in the completion). Please reduce the length of the {what} or completion.",
                what,
            )
