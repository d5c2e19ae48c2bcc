"""The gateway's side of the pipeline: requests down, token deltas back to their waiters.

A request goes to a tokenizer replica (`routing.TokenizerRouter`: round robin over the live
ones), which answers with its TokenizedRequest (or a RequestError); the gateway passes that
on to an engine's scheduler (`engine_links.EngineLinks`: the engine the router picks with
data parallelism) and the scheduler sends the request's tokens straight back here, one frame
per step (an embedding request: one PooledOutput, its pooled vector). Each request in flight is a RequestStream with its own asyncio.Queue and its
RequestText (`output_text`): `next()` turns the engine's deltas into the client's text,
stop strings included (a stop found here is told to the engine, FinishRequest). A request
left before its last delta (client gone, timeout, handler cancelled) is aborted at its
engine, on the same pipe as the request, so the abort never overtakes it. A queue holds at
most `max_buffered` messages: a handler that falls that far behind (its client stopped
reading) has its request aborted at once. Deltas for a request id nobody waits for (aborted,
or replaced by a resumed one) that are not final get an abort back, once.

Recovery. A tokenizer replica holds nothing once it answered, so when one is lost only the
requests still waiting for its answer are asked again, of another replica. When an engine's
scheduler restarts (it lost every request) or the engine stops serving while others serve,
each of its requests resumes: every unfinished choice is sent again (under a new id, to the
engine the router picks) with the tokens the client has as its output so far
(`TokenizedRequest.output_token_ids`); the engine recomputes prompt + those tokens and goes
on, and its tokens continue through the same RequestText, so the client sees one answer,
nothing repeated or skipped, whether the request is greedy, seeded or sampled without a
seed. A choice of an n-sample request resumes as a request of its own (n = 1, its sample's
seed: seed + index, as the scheduler seeds samples); a beam search, which sends nothing
before it ends, starts again. A scheduler gone for good (see the watchdog) ends them all with
a 503. Every request names this gateway: its DEALER identity, and a GatewayBeat to every
scheduler each GATEWAY_BEAT_S, so a scheduler aborts the requests of a gateway that died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import zmq.asyncio

from services.gateway.engine_links import EngineLinks, EngineUnreachable
from services.gateway.engine_router import EngineLoads
from services.gateway.output_text import BadTokens, RequestText, TextDelta
from services.gateway.routing import TokenizerRouter
from services.gateway.token_text import TokenTexts
from shared.config import Addresses
from shared.heartbeat import INSTANCE_ID
from shared.messages import (
    AbortRequest,
    DetokenizeRequest,
    FinishRequest,
    GatewayBeat,
    GatewayToTokenizer,
    GenerateRequest,
    PooledOutput,
    RequestError,
    StepDeltas,
    TokenDelta,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
    TokenizerToGateway,
    WatchPool,
)
from shared.transport import AsyncPullSocket, AsyncRouterSocket

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5  # a request is sent (or resumed) at most this many times
DEFAULT_MAX_BUFFERED = 1024  # messages waiting for one request's handler
GATEWAY_BEAT_S = 0.5  # well inside the schedulers' GATEWAY_LOST_AFTER_S
MAX_ORPHANS = 4096  # request ids remembered as aborted for their stray deltas


class EngineError(Exception):
    """The request ended with a RequestError (from the pipeline or from the gateway)."""

    def __init__(self, err: RequestError):
        super().__init__(err.message)
        self.err = err


class RequestTimeout(Exception):
    pass


class _Retry:
    """Queued to a stream whose tokenizer replica, or whose engine, was lost."""

    def __init__(self, stage: str, engine: str | None = None):
        self.stage = stage
        self.engine = engine  # None: the tokenizer replica


class _Lost:
    """Queued to a stream whose request a lost stage took with it."""

    def __init__(self, message: str):
        self.message = message


def unavailable(request_id: str, message: str) -> RequestError:
    return RequestError(request_id, 503, message, error_type="service_unavailable")


class EngineClient:
    def __init__(self, ctx: zmq.asyncio.Context, addrs: Addresses, tokenizer, vocab_size: int, *,
                 replicas: Callable[[], list[str]], on_retry: Callable[[], None] = lambda: None,
                 max_buffered: int = DEFAULT_MAX_BUFFERED, on_routed: Callable[[str], None] = lambda engine: None,
                 routing: str = "prefix"):
        """tokenizer: the model's (it detokenizes); replicas: the names of the live tokenizer
        replicas, asked before each send."""
        self.max_buffered = max_buffered
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)
        self.vocab_size = vocab_size
        self.instance = INSTANCE_ID
        self._to_tokenizer = TokenizerRouter(AsyncRouterSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer), replicas)
        self._from_tokenizer = AsyncPullSocket(ctx, addrs.gateway_in, TokenizerToGateway, bind=True)
        self.engines = EngineLinks(ctx, addrs.scheduler_in.split(","), f"gateway-{INSTANCE_ID}", routing, on_routed)
        self._streams: dict[str, RequestStream] = {}  # by the client's request id
        self._pipelines: dict[str, tuple[RequestStream, int | None]] = {}  # engine request id -> (stream, choice)
        self._calls: dict[str, asyncio.Future] = {}  # one-shot requests (/tokenize, /detokenize) by id
        self._orphans: OrderedDict[str, None] = OrderedDict()
        self.on_retry = on_retry

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted that have not produced a token yet: the waiting queue."""
        return sum(1 for s in self._streams.values() if not s.started)

    async def run_reader(self) -> None:
        """Read the tokenizer replicas' answers and every engine's deltas, until cancelled."""
        await asyncio.gather(self._read_tokenizers(), *(self._read_engine(e) for e in self.engines.engines))

    async def _read_tokenizers(self) -> None:
        while True:
            try:
                msg = await self._from_tokenizer.recv()
                self._on_tokenizer(msg)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading gateway_in failed")
                await asyncio.sleep(0.1)

    def _on_tokenizer(self, msg: TokenizedRequest | RequestError | TokenizeResult) -> None:
        call = self._calls.pop(msg.request_id, None)
        if call is not None:
            if not call.done():
                call.set_result(msg)
            return
        stream = self._streams.get(msg.request_id)
        if stream is None or stream.tokenized is not None:
            return  # gone, or answered already (a second replica asked after the first was lost)
        if isinstance(msg, TokenizedRequest):
            stream.on_tokenized(msg)
        elif isinstance(msg, RequestError):
            stream.asked = None
            stream.queue.put_nowait(msg)

    async def _read_engine(self, engine: str) -> None:
        sock = self.engines.sockets[engine]
        while True:
            try:
                msg = await sock.recv()
                for item in msg.deltas if isinstance(msg, StepDeltas) else [msg]:
                    self._on_engine(engine, item)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading engine %s failed", engine)
                await asyncio.sleep(0.1)

    def _on_engine(self, engine: str, msg: TokenDelta | RequestError | PooledOutput) -> None:
        entry = self._pipelines.get(msg.request_id)
        if entry is None:
            if isinstance(msg, TokenDelta) and msg.finish_reason is None:
                self._abort_orphan(engine, msg.request_id)
            return
        stream = entry[0]
        if stream.queue.qsize() >= self.max_buffered:
            self._overflow(stream)
            return
        if isinstance(msg, RequestError):
            stream.queue.put_nowait(msg)
            return
        if msg.request_id not in stream.prefilled:
            stream.prefilled.add(msg.request_id)
            self.engines.prefilled(msg.request_id)
        stream.queue.put_nowait((msg, entry[1]))

    def _abort_orphan(self, engine: str, request_id: str) -> None:
        """A request nobody reads any more still runs there: stop it (once)."""
        if request_id in self._orphans:
            return
        self._orphans[request_id] = None
        if len(self._orphans) > MAX_ORPHANS:
            self._orphans.popitem(last=False)
        self.engines.send_to(engine, AbortRequest(request_id))

    def _overflow(self, stream: RequestStream) -> None:
        log.warning("%s: the client does not read fast enough; aborting it", stream.request_id)
        stream.stop()
        stream.queue.put_nowait(RequestError(
            stream.request_id, 408, "The client did not read the response fast enough; the request was aborted.",
            error_type="timeout_error"))

    async def call(self, msg: TokenizeRequest | DetokenizeRequest, timeout_s: float) -> TokenizeResult:
        """A one-shot request to any tokenizer replica and its answer (EngineError for a
        RequestError, RequestTimeout past timeout_s)."""
        answer = asyncio.get_running_loop().create_future()
        self._calls[msg.request_id] = answer
        try:
            await asyncio.wait_for(self._to_tokenizer.send(msg), timeout_s)
            reply = await asyncio.wait_for(answer, timeout_s)
        except TimeoutError as exc:
            raise RequestTimeout from exc
        except OverflowError as exc:  # e.g. a tool schema's integer beyond 64 bits: msgpack cannot carry it
            raise EngineError(RequestError(msg.request_id, 400,
                                           f"The request holds a value no stage can take: {exc}.")) from exc
        finally:
            self._calls.pop(msg.request_id, None)
        if isinstance(reply, RequestError):
            raise EngineError(reply)
        return reply

    def open(self, request: GenerateRequest, timeout_s: float) -> RequestStream:
        return RequestStream(self, request, time.monotonic() + timeout_s)

    def request_text(self, msg: TokenizedRequest, request: GenerateRequest) -> RequestText:
        prompt_text = None
        if msg.params.echo:
            prompt_text = request.prompt if request.prompt is not None else self.tokenizer.decode(
                msg.prompt_token_ids, skip_special_tokens=msg.params.skip_special_tokens)
        return RequestText(self.texts, msg, prompt_text, self.vocab_size)

    async def run_upkeep(self) -> None:
        """A GatewayBeat to every scheduler every GATEWAY_BEAT_S."""
        beat = GatewayBeat(self.instance)
        while True:
            self.engines.broadcast(beat)
            await asyncio.sleep(GATEWAY_BEAT_S)

    async def watch_pool(self, msg: WatchPool) -> None:
        """A dashboard's subscription, to every scheduler."""
        self.engines.broadcast(msg)

    def tokenizer_lost(self, replica: str) -> int:
        """Ask another replica for the requests the lost one had not answered."""
        hit = [s for s in self._streams.values() if s.tokenized is None and s.asked == replica]
        for stream in hit:
            stream.interrupt(_Retry("tokenizer replica"))
        return len(hit)

    def scheduler_restarted(self, engine: str) -> int:
        """A new scheduler instance knows none of the requests it had: resume them."""
        return self._resume_engine(engine, "scheduler")

    def engine_lost(self, engine: str) -> int:
        """An engine stopped serving while others serve: its requests resume on them."""
        return self._resume_engine(engine, f"engine {engine}")

    def _resume_engine(self, engine: str, stage: str) -> int:
        hit = [s for s in self._streams.values() if s.runs_on(engine)]
        for stream in hit:
            stream.interrupt(_Retry(stage, engine))
        return len(hit)

    def update_engines(self, loads: EngineLoads) -> None:
        self.engines.update(loads)

    def scheduler_lost(self, message: str) -> int:
        streams = list(self._streams.values())
        for stream in streams:
            stream.interrupt(_Lost(message))
        return len(streams)

    def close(self) -> None:
        self._to_tokenizer.close()
        self._from_tokenizer.close()
        self.engines.close()


class RequestStream:
    """`async with client.open(req, timeout) as stream`: then `await stream.next()`."""

    def __init__(self, client: EngineClient, request: GenerateRequest, deadline: float):
        self._client = client
        self._request = request
        self._deadline = deadline
        self.request_id = request.request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.asked: str | None = None  # the tokenizer replica asked, until it answers
        self.tokenized: TokenizedRequest | None = None
        self.text: RequestText | None = None
        self.pipelines: dict[str, int | None] = {}  # engine request id -> the choice it runs (None: all)
        self.prefilled: set[str] = set()  # engine request ids whose first delta came
        self.attempt = 0
        self.started = False  # a token came back
        self.done = False  # every choice finished: nothing to abort
        self._interrupted = False  # a retry or a loss is queued

    async def __aenter__(self) -> RequestStream:
        if self.request_id in self._client._streams:
            raise EngineError(RequestError(self.request_id, 400, "duplicate request id", param="request_id"))
        self._client._streams[self.request_id] = self
        try:
            await self._ask_tokenizer()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        if self._client._streams.get(self.request_id) is self:
            del self._client._streams[self.request_id]
        self.stop()

    def stop(self) -> None:
        """Abort whatever still runs of the request (released only, once it finished)."""
        for pipeline in list(self.pipelines):
            self._drop(pipeline, abort=not self.done)
        if self.asked is not None and self.tokenized is None and not self.done:
            self._client._to_tokenizer.send_nowait(AbortRequest(self.request_id), to=self.asked)
        self.asked = None

    def _drop(self, pipeline: str, abort: bool) -> None:
        self.pipelines.pop(pipeline, None)
        self._client._pipelines.pop(pipeline, None)
        if abort:
            self._client.engines.abort(pipeline)
        else:
            self._client.engines.release(pipeline)

    def runs_on(self, engine: str) -> bool:
        return any(self._client.engines.owner(p) == engine for p in self.pipelines)

    async def _ask_tokenizer(self) -> None:
        try:
            # Waits while no tokenizer replica can take it; the deadline still holds.
            self.asked = await asyncio.wait_for(self._client._to_tokenizer.send(self._request), self._remaining())
        except TimeoutError as exc:
            raise RequestTimeout from exc

    def on_tokenized(self, msg: TokenizedRequest) -> None:
        self.tokenized, self.asked = msg, None
        self.text = self._client.request_text(msg, self._request)
        self._submit(msg, None)

    def _submit(self, msg: TokenizedRequest, choice: int | None) -> None:
        self.pipelines[msg.request_id] = choice
        self._client._pipelines[msg.request_id] = (self, choice)
        try:
            self._client.engines.submit(msg)
        except EngineUnreachable as exc:
            self.queue.put_nowait(unavailable(msg.request_id, f"The engine {exc} does not take requests; please "
                                                              "retry."))

    def interrupt(self, item: _Retry | _Lost) -> None:
        if not self._interrupted and not self.done:
            self._interrupted = True
            self.queue.put_nowait(item)

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout
        return remaining

    async def next(self) -> TextDelta | PooledOutput:
        """The next TextDelta (an embedding request: its one PooledOutput); raises EngineError for
        an error, RequestTimeout past the deadline."""
        while True:
            remaining = self._remaining()
            try:  # no task per token (as wait_for makes) when the delta is already queued
                item = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(remaining):
                        item = await self.queue.get()
                except TimeoutError as exc:
                    raise RequestTimeout from exc
            if isinstance(item, _Retry):
                self._interrupted = False
                await self._retry(item)
                continue
            if isinstance(item, _Lost):
                raise EngineError(unavailable(self.request_id, item.message))  # not done: aborted on exit
            if isinstance(item, RequestError):
                self.pipelines.pop(item.request_id, None)  # ended there: the other pipelines are aborted on exit
                self._client._pipelines.pop(item.request_id, None)
                raise EngineError(msgspec.structs.replace(item, request_id=self.request_id))
            delta = self._text(*item)
            if delta is not None:
                return delta

    def _text(self, msg: TokenDelta | PooledOutput, choice: int | None) -> TextDelta | PooledOutput | None:
        if msg.request_id not in self.pipelines:
            return None  # from a run that was replaced
        if isinstance(msg, PooledOutput):  # an embedding request's whole answer
            self.started = self.done = True
            self.stop()
            return msgspec.structs.replace(msg, request_id=self.request_id)
        index = msg.seq_index if choice is None else choice
        self.started = True
        try:
            delta = self.text.on_delta(msg, index)
        except BadTokens as exc:
            log.error("request %s: token ids outside the vocabulary from the engine", self.request_id)
            raise EngineError(RequestError(self.request_id, 500, "internal error: the model produced an invalid "
                                           "token id", "internal_error")) from exc
        if delta is None:
            return None
        if delta.finish_reason is not None and msg.finish_reason is None:  # a stop string, found here
            self._client.engines.finish(FinishRequest(msg.request_id, "stop", msg.seq_index if choice is None
                                                      else None))
        if self.text.done:
            self.done = True
            self.stop()
        return delta  # RequestText names the client's request id, whichever run the tokens came from

    async def _retry(self, retry: _Retry) -> None:
        if self.attempt + 1 >= MAX_ATTEMPTS:
            raise EngineError(unavailable(self.request_id, f"The {retry.stage} serving this request failed too "
                                                           "often; please retry."))
        if retry.engine is None:  # the tokenizer replica asked was lost before it answered
            if self.tokenized is not None:
                return
            log.warning("%s: tokenizer replica %s lost; asking another", self.request_id, self.asked)
            self.attempt += 1
            self._client.on_retry()
            await self._ask_tokenizer()
            return
        lost = [p for p in self.pipelines if self._client.engines.owner(p) == retry.engine]
        if not lost:
            return
        unfinished = set(self.text.unfinished())
        choices: set[int] = set()
        for pipeline in lost:
            choice = self.pipelines[pipeline]
            choices |= unfinished if choice is None else {choice} & unfinished
            self._drop(pipeline, abort=True)
        self.attempt += 1
        self._client.on_retry()
        log.warning("%s: %s lost; resuming %d choices", self.request_id, retry.stage, len(choices))
        for msg, choice in self._resumed(sorted(choices)):
            self._submit(msg, choice)

    def _resumed(self, choices: list[int]) -> list[tuple[TokenizedRequest, int | None]]:
        """The requests that continue these choices from what the client has."""
        base, p = self.tokenized, self.tokenized.params
        if p.use_beam_search:  # nothing was sent before the search ended: it starts again
            return [(msgspec.structs.replace(base, request_id=f"{self.request_id}-r{self.attempt}"), None)]
        out = []
        for choice in choices:
            params = msgspec.structs.replace(
                p, n=1, seed=None if p.seed is None else p.seed + choice,
                prompt_logprobs=p.prompt_logprobs if self.text.prompt_logprobs is None and choice == choices[0]
                else None)
            pipeline = f"{self.request_id}-r{self.attempt}" + (f"-{choice}" if p.n > 1 else "")
            out.append((msgspec.structs.replace(base, request_id=pipeline, params=params,
                                                output_token_ids=self.text.received(choice)), choice))
        return out
