"""vLLM's /tokenize and /detokenize bodies, as the tokenizer stage's requests."""

from __future__ import annotations

from services.gateway.openai.chat import chat_options, parse_messages
from services.gateway.openai.errors import wrong_type
from services.gateway.openai.readers import boolean, is_token_id
from services.gateway.openai.request import check_model
from shared.messages import DetokenizeRequest, TokenizeRequest


def parse_tokenize(body: dict, model_names: set[str], request_id: str) -> TokenizeRequest:
    """vLLM's /tokenize: a prompt, or chat messages with the chat fields."""
    check_model(body, model_names)
    add_special = boolean(body, "add_special_tokens", None)
    strs = boolean(body, "return_token_strs", False)
    if body.get("messages") is not None:
        return TokenizeRequest(request_id, messages=parse_messages(body), chat=chat_options(body),
                               add_special_tokens=add_special, return_token_strs=strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise wrong_type("prompt", "a string (or send 'messages')", prompt)
    return TokenizeRequest(request_id, prompt=prompt, add_special_tokens=add_special, return_token_strs=strs)


def parse_detokenize(body: dict, model_names: set[str], request_id: str) -> DetokenizeRequest:
    check_model(body, model_names)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_token_id(t) for t in tokens):
        raise wrong_type("tokens", "an array of token ids", tokens)
    return DetokenizeRequest(request_id, tokens)
