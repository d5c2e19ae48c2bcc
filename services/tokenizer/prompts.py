"""Turn a GenerateRequest into prompt token ids, or a 400 that says what is wrong.

Chat messages go through the model's chat template (with the assistant turn opened);
a text prompt is tokenized as the tokenizer does by default; token ids are checked
against the vocabulary. Every prompt must leave room for max_tokens in the context;
a request without max_tokens (None) gets the rest of the context (`resolve_max_tokens`).
"""

from __future__ import annotations

import msgspec
from jinja2 import TemplateError

from shared.messages import GenerateRequest, SamplingParams


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

    def build(self, req: GenerateRequest) -> list[int]:
        if req.messages is not None:
            ids, what = self._chat(req), "messages"
        elif req.prompt_token_ids is not None:
            ids, what = self._check_ids(req.prompt_token_ids), "prompt"
        elif req.prompt is not None:
            ids, what = self.tokenizer.encode(req.prompt), "prompt"
        else:
            raise PromptError("The request has no prompt and no messages.", "prompt")
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

    def _chat(self, req: GenerateRequest) -> list[int]:
        if not req.messages:
            raise PromptError("messages must hold at least one message.", "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("This model has no chat template: use /v1/completions.", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in req.messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        except TemplateError as exc:  # templates raise on conversations they reject
            raise PromptError(f"The chat template rejected the messages: {exc}", "messages") from exc
        # The template already writes every special token the model expects.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _check_ids(self, ids: list[int]) -> list[int]:
        for tok in ids:
            if not 0 <= tok < self.vocab_size:
                raise PromptError(
                    f"Token id {tok} is out of vocabulary: ids must be in [0, {self.vocab_size}).", "prompt"
                )
        return list(ids)

    def resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """params with max_tokens set: None becomes the rest of the context."""
        if params.max_tokens is not None:
            return params
        return msgspec.structs.replace(params, max_tokens=self.max_model_len - prompt_len)

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
