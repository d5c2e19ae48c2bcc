"""What a tokenizer replica does with each message from the gateway, apart from sockets
and model loading. A replica is a stateless worker: it answers each message to the
gateway (`to_gateway`) and keeps nothing of a request once it answered, so any replica
takes any request and one that dies loses nothing the gateway cannot send again.

- GenerateRequest: the prompt through the chat template and the tokenizer
  (`prompts.PromptBuilder`), max_tokens resolved and bad_words made token ids; answered
  with a TokenizedRequest, which the gateway passes on to an engine, or a RequestError
  400 (a bad prompt or parameter).
- With structured output the request waits, off the loop, for its spec to compile in the
  grammar worker pool (`grammar_pool`; `poll_grammars` collects the answers every loop
  turn): the TokenizedRequest then carries the compiled grammar, or the answer is a 400
  (a bad spec, one past the pool's time or size limit, or no xgrammar on this server).
  These requests, while they compile, are all a replica holds; a second request with
  the id of one of them is refused (400).
- AbortRequest: cancels the compile of that request if it is compiling (no answer: the
  gateway has ended it); otherwise there is nothing to stop and it is dropped.
- TokenizeRequest / DetokenizeRequest (/tokenize, /detokenize): a TokenizeResult at once.

A failure while handling one message ends that request with a 500 and nothing else;
a grammar pool that breaks fails the requests compiling in it (500) and is replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.tokenizer.grammar_pool import GrammarPool
from services.tokenizer.prompts import PromptBuilder, PromptError
from shared import structured_output
from shared.messages import (
    AbortRequest,
    DetokenizeRequest,
    GatewayToTokenizer,
    GenerateRequest,
    RequestError,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
    TokenizerToGateway,
)

log = logging.getLogger(__name__)


class TokenizerStage:
    def __init__(
        self,
        tokenizer,
        prompts: PromptBuilder,
        eos_token_ids: list[int],
        to_gateway: Callable[[TokenizerToGateway], None],
        grammars: GrammarPool | None = None,
    ):
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.eos_token_ids = eos_token_ids
        self._to_gateway = to_gateway
        self.grammars = grammars  # made on the first constrained request when not given
        self.compiling: dict[str, TokenizedRequest] = {}  # waiting for their grammar

    def handle(self, msg: GatewayToTokenizer) -> None:
        try:
            if isinstance(msg, AbortRequest):
                if self.compiling.pop(msg.request_id, None) is not None:
                    self.grammars.cancel(msg.request_id)
            elif isinstance(msg, TokenizeRequest | DetokenizeRequest):
                self._on_tokenize(msg)
            else:
                self._on_generate(msg)
        except Exception as exc:
            log.exception("request %s failed", msg.request_id)
            self._fail(msg.request_id, f"internal error in the tokenizer: {exc}")

    def _on_tokenize(self, msg: TokenizeRequest | DetokenizeRequest) -> None:
        limit = self.prompts.max_model_len
        try:
            if isinstance(msg, DetokenizeRequest):
                ids = self.prompts.check_ids(msg.token_ids)
                text = self.tokenizer.decode(ids)
                self._to_gateway(TokenizeResult(msg.request_id, [], limit, text=text))
                return
            ids = self.prompts.tokenize(msg)[0] if (msg.prompt or msg.messages) else []
        except PromptError as exc:
            self._to_gateway(RequestError(msg.request_id, 400, str(exc), param=exc.param))
            return
        strs = self.tokenizer.convert_ids_to_tokens(ids) if msg.return_token_strs else None
        self._to_gateway(TokenizeResult(msg.request_id, ids, limit, token_strs=strs))

    def _on_generate(self, req: GenerateRequest) -> None:
        if req.request_id in self.compiling:
            self._to_gateway(RequestError(req.request_id, 400, "duplicate request id", param="request_id"))
            return
        try:
            ids = self.prompts.build(req)
        except PromptError as exc:
            self._to_gateway(RequestError(req.request_id, 400, str(exc), param=exc.param))
            return
        params = self.prompts.resolve_max_tokens(req.params, len(ids))
        answer = TokenizedRequest(request_id=req.request_id, prompt_token_ids=ids, params=params,
                                  eos_token_ids=self.eos_token_ids, arrival_time=time.time(), priority=req.priority)
        if params.structured is None:
            self._to_gateway(answer)
            return
        if not structured_output.available():
            self._to_gateway(RequestError(req.request_id, 400, "Structured output needs xgrammar on this server "
                                          "(pip install 'pagedserve[structured]').", param="response_format"))
            return
        if self.grammars is None:
            self.grammars = GrammarPool.for_tokenizer(self.tokenizer, self.prompts.vocab_size)
        self.compiling[req.request_id] = answer
        self.grammars.submit(req.request_id, params.structured)

    def poll_grammars(self) -> bool:
        """Answer the requests whose grammar is compiled (or refused); True if there were any."""
        if self.grammars is None:
            return False
        try:
            answered = self.grammars.poll()
        except Exception:  # the pool is broken: its requests end, the replica goes on
            log.exception("grammar pool failed")
            for request_id in list(self.compiling):
                self._fail(request_id, "internal error while compiling the grammar")
            self.grammars.close()
            self.grammars = self.grammars.fresh()
            return True
        for request_id, compiled, error in answered:
            answer = self.compiling.pop(request_id, None)
            if answer is None:
                continue  # aborted meanwhile
            if error:
                self._to_gateway(RequestError(request_id, 400, error, param="response_format"))
                continue
            answer.compiled_grammar = compiled
            self._to_gateway(answer)
        return bool(answered)

    def _fail(self, request_id: str, message: str) -> None:
        if self.compiling.pop(request_id, None) is not None and self.grammars is not None:
            self.grammars.cancel(request_id)
        self._to_gateway(RequestError(request_id, 500, message, error_type="internal_error"))
