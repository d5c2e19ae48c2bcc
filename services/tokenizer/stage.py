"""What a tokenizer replica does with each message, apart from sockets and model loading.

Requests from the gateway are tokenized and passed on to the scheduler; token deltas
from the scheduler are detokenized and passed back to the gateway. The replica keeps
one Detokenizer per request it forwarded, until that request finishes, fails or is
aborted (also when the gateway that sent it is gone: `abort_gateway`); deltas for a
request it no longer knows are ignored. A dashboard's WatchPool
is passed on to the scheduler as it is. A failure while handling
one request, or token ids outside the vocabulary, end that request with a 500 and
nothing else.

A request with structured output waits, off the loop, for its spec to compile in the
grammar worker pool (`grammar_pool`; `poll_grammars` collects the answers every loop
turn): then it goes on to the scheduler with the compiled grammar, or ends with a 400
(a bad spec, or one past the pool's time or size limit). With n samples and prompt
logprobs, the prompt's entries are filled once and sent on the request's first delta
only; the gateway shares them among the request's choices.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.detokenizer import Detokenizer
from services.tokenizer.grammar_pool import GrammarPool
from services.tokenizer.prompts import PromptBuilder, PromptError
from services.gateway.token_text import TokenTexts
from shared import structured_output
from shared.messages import (
    AbortRequest,
    DetokenizeRequest,
    FinishRequest,
    GatewayToTokenizer,
    GenerateRequest,
    RequestError,
    SchedulerToTokenizer,
    TextDelta,
    TokenDelta,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
    TokenizerToGateway,
    TokenizerToScheduler,
    TokenLogprob,
    WatchPool,
)

log = logging.getLogger(__name__)


@dataclass
class _Active:
    """One request's text state: a Detokenizer per choice still generating (n > 1 and
    beam search give several), made on its first tokens."""

    tokenizer: object
    params: object
    prompt_ids: list[int]
    prompt_text: str | None = None  # echo: the prompt as given (or decoded from its ids)
    detoks: dict[int, Detokenizer] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    prompt_logprobs: list[TokenLogprob] | None = None  # filled with token texts once
    gateway: str = ""  # the instance of the gateway that sent it
    prompt_logprobs_sent: bool = False  # on one delta of the request: its choices share them

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def detok(self, seq_index: int) -> Detokenizer:
        if seq_index not in self.detoks:
            self.detoks[seq_index] = Detokenizer(
                self.tokenizer, self.params, self.prompt_ids, skip_special_tokens=self.params.skip_special_tokens,
                spaces_between_special_tokens=self.params.spaces_between_special_tokens)
        return self.detoks[seq_index]

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.params.n


class TokenizerStage:
    def __init__(
        self,
        tokenizer,
        prompts: PromptBuilder,
        eos_token_ids: list[int],
        to_gateway: Callable[[TokenizerToGateway], None],
        to_scheduler: Callable[[TokenizerToScheduler], None],
        grammars: GrammarPool | None = None,
    ):
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.prompts = prompts
        self.eos_token_ids = eos_token_ids
        self._to_gateway = to_gateway
        self._to_scheduler = to_scheduler
        self.active: dict[str, _Active] = {}
        self.grammars = grammars  # made on the first constrained request when not given
        self.compiling: dict[str, tuple[_Active, TokenizedRequest]] = {}  # waiting for their grammar

    def handle_gateway(self, msg: GatewayToTokenizer) -> None:
        if isinstance(msg, WatchPool):  # a dashboard's subscription, for the scheduler alone
            self._to_scheduler(msg)
            return
        self._guarded(msg.request_id, self._on_gateway, msg)

    def handle_scheduler(self, msg: SchedulerToTokenizer) -> None:
        self._guarded(msg.request_id, self._on_scheduler, msg)

    def _guarded(self, request_id: str, handler, msg) -> None:
        try:
            handler(msg)
        except Exception as exc:
            log.exception("request %s failed", request_id)
            self._fail(request_id, 500, f"internal error in the tokenizer: {exc}", "internal_error")

    def _on_gateway(self, msg: GatewayToTokenizer) -> None:
        if isinstance(msg, AbortRequest):
            self.active.pop(msg.request_id, None)
            if self.compiling.pop(msg.request_id, None) is not None:
                self.grammars.cancel(msg.request_id)
            self._to_scheduler(msg)
        elif isinstance(msg, TokenizeRequest | DetokenizeRequest):
            self._on_tokenize(msg)
        else:
            self._on_generate(msg)

    def _on_tokenize(self, msg: TokenizeRequest | DetokenizeRequest) -> None:
        """/tokenize and /detokenize: answered at once, nothing kept."""
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
        if req.request_id in self.active or req.request_id in self.compiling:
            self._to_gateway(RequestError(req.request_id, 400, "duplicate request id", param="request_id"))
            return
        try:
            ids = self.prompts.build(req)
        except PromptError as exc:
            self._to_gateway(RequestError(req.request_id, 400, str(exc), param=exc.param))
            return
        params = self.prompts.resolve_max_tokens(req.params, len(ids))
        prompt_text = None
        if params.echo:
            prompt_text = req.prompt if req.prompt is not None else self.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens)
        state = _Active(self.tokenizer, params, ids, prompt_text, gateway=req.gateway_instance)
        forward = TokenizedRequest(request_id=req.request_id, prompt_token_ids=ids, params=params,
                                   eos_token_ids=self.eos_token_ids, arrival_time=time.time())
        if params.structured is None:
            self.active[req.request_id] = state
            self._to_scheduler(forward)
            return
        if not structured_output.available():
            self._to_gateway(RequestError(req.request_id, 400, "Structured output needs xgrammar on this server "
                                          "(pip install 'pagedserve[structured]').", param="response_format"))
            return
        if self.grammars is None:
            self.grammars = GrammarPool.for_tokenizer(self.tokenizer, self.prompts.vocab_size)
        self.compiling[req.request_id] = (state, forward)
        self.grammars.submit(req.request_id, params.structured)

    def poll_grammars(self) -> bool:
        """Send on (or fail) the requests whose grammar is answered; True if there were any."""
        if self.grammars is None:
            return False
        try:
            answered = self.grammars.poll()
        except Exception:  # the pool is broken: its requests end, the replica goes on
            log.exception("grammar pool failed")
            for request_id in list(self.compiling):
                self._fail(request_id, 500, "internal error while compiling the grammar", "internal_error")
            self.grammars.close()
            self.grammars = self.grammars.fresh()
            return True
        for request_id, compiled, error in answered:
            pending = self.compiling.pop(request_id, None)
            if pending is None:
                continue  # aborted meanwhile
            state, forward = pending
            if error:
                self._to_gateway(RequestError(request_id, 400, error, param="response_format"))
                continue
            forward.compiled_grammar = compiled
            self.active[request_id] = state
            self._to_scheduler(forward)
        return bool(answered)

    def _on_scheduler(self, msg: SchedulerToTokenizer) -> None:
        if isinstance(msg, RequestError):
            if self.active.pop(msg.request_id, None) is not None:
                self._to_gateway(msg)
            return
        self._on_tokens(msg)

    def _on_tokens(self, delta: TokenDelta) -> None:
        state = self.active.get(delta.request_id)
        if state is None:
            return  # finished by a stop string, aborted, or failed already
        index = delta.seq_index
        if index in state.finished:
            return  # this choice ended on a stop string already
        if delta.finish_reason == "abort":
            del self.active[delta.request_id]
            return
        vocab = self.prompts.vocab_size
        if any(not 0 <= t < vocab for t in delta.token_ids):
            # a broken or forged peer: this request ends, the replica goes on
            log.error("request %s: token ids outside the vocabulary from the scheduler", delta.request_id)
            self._fail(delta.request_id, 500, "internal error: the model produced an invalid token id",
                       "internal_error")
            return
        first = index not in state.detoks
        detok = state.detok(index)
        finish = delta.finish_reason
        text = detok.step(delta.token_ids, final=finish is not None)
        stop_reason = delta.stop_token_id if delta.stop_token_id in state.params.stop_token_ids else None
        if detok.stopped:
            if finish is None:
                self._to_scheduler(FinishRequest(delta.request_id, "stop", seq_index=index))
            finish, stop_reason = "stop", detok.stop_reason
        if finish is not None:
            state.finished.add(index)
            if state.done:
                del self.active[delta.request_id]
        # Sent even with no text to show yet: the gateway counts tokens and times them.
        out = TextDelta(
            request_id=delta.request_id,
            text=text,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=detok.num_output_tokens,
            finish_reason=finish,
            token_ids=delta.token_ids,
            seq_index=index,
            logprobs=self.token_texts.fill(delta.logprobs),
            stop_reason=stop_reason if finish == "stop" else None,
            num_cached_tokens=delta.num_cached_tokens,
        )
        if first:
            self._add_prompt(state, delta, out)
        self._to_gateway(out)

    def _add_prompt(self, state: _Active, delta: TokenDelta, out: TextDelta) -> None:
        """A sequence's first delta carries the prompt when the client asked to see it; the
        prompt's logprob entries (prompt length x top candidates, each with its text and
        bytes) are filled once and sent on one delta of the request only, not once per
        sample: the gateway gives them to each of the request's choices."""
        params = state.params
        if params.echo:
            out.prompt_text = state.prompt_text
        if params.prompt_logprobs is not None:
            if state.prompt_logprobs is None and delta.prompt_logprobs:
                first = TokenLogprob(state.prompt_ids[0], 0.0, 0)  # rank 0: not scored
                state.prompt_logprobs = self.token_texts.fill([first, *delta.prompt_logprobs])
            if state.prompt_logprobs and not state.prompt_logprobs_sent:
                out.prompt_logprobs = state.prompt_logprobs
                state.prompt_logprobs_sent = True
        if params.echo or params.prompt_logprobs is not None:
            out.prompt_token_ids = state.prompt_ids

    def abort_gateway(self, instances: set[str]) -> int:
        """Abort every request of these gateway instances (gone: nobody reads them); how many."""
        compiling = [rid for rid, (state, _) in self.compiling.items() if state.gateway and state.gateway in instances]
        for request_id in compiling:  # not sent on yet: nothing to abort downstream
            del self.compiling[request_id]
            self.grammars.cancel(request_id)
        gone = [rid for rid, state in self.active.items() if state.gateway and state.gateway in instances]
        for request_id in gone:
            del self.active[request_id]
            self._to_scheduler(AbortRequest(request_id))
        return len(gone) + len(compiling)

    def _fail(self, request_id: str, status: int, message: str, error_type: str) -> None:
        self.compiling.pop(request_id, None)
        if self.active.pop(request_id, None) is not None:
            self._to_scheduler(AbortRequest(request_id))  # it may be holding KV blocks
        self._to_gateway(RequestError(request_id, status, message, error_type=error_type))
