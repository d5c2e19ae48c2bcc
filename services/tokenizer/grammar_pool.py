"""Grammar compilation for the tokenizer stage: worker processes, a time limit, a size limit.

xgrammar compiles in C++ and holds its thread until it is done: a Python signal handler
runs only once the compile returns (measured: a 0.5 s alarm during a 3.6 s compile of a
100-property schema on SmolLM2 fired at 3.6 s), and a thread cannot be killed. So a
compile runs in a spawned worker process, which is killed (and replaced) when its compile
runs past the limit. Each worker builds its compiler once, from the TokenizerInfo the
stage serialized, so that every worker and the stage agree on the vocabulary.

The stage's loop never waits on a worker: `submit` queues a spec, and `poll` (every loop
turn) collects answers without blocking, kills workers past their deadline and hands
queued specs to idle workers. Requests for a spec already queued or compiling share that
one compile; answers are cached by spec (the least recently used dropped, bounded by
count and bytes). An answer is the grammar's serialized form (`serialize_json`), which the
request carries to the executor; one larger than `max_bytes` is refused. Every submitted
request gets exactly one answer: the compiled form, or an error message (a bad spec, the
time limit, the size limit, a worker that died) that the stage turns into a 400. A spec
waits in the queue at most `timeout_s` while every worker is up (starting one takes
seconds: importing xgrammar), then compiles for at most `timeout_s`.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from shared.messages import StructuredOutput
from shared.options import option

log = logging.getLogger(__name__)

# Serialized compiled grammars: 92 KB for any JSON object on SmolLM2; the executor takes
# about 30 ms a MiB to deserialize one (123 ms for 3.8 MiB), once per spec, beside a forward.
MAX_BYTES = 4 << 20
CACHE_SIZE = 256  # compiled forms kept
CACHE_BYTES = 256 << 20
# Heap a worker may add past what it holds once loaded. A compiled grammar can be small in
# memory and huge serialized (nested oneOf: 3 MB compiled, over 1 GB as JSON at depth 9):
# past this, xgrammar's allocation fails (std::bad_alloc) instead of the host running out.
WORKER_HEAP_BYTES = 2 << 30
FAILED_STARTS = 3  # workers dying before they are up, in a row, before the pool gives up


@dataclass(frozen=True)
class GrammarOptions:
    """structured output (the tokenizer's grammar compiler pool)"""

    grammar_compile_timeout: float = option(10.0, "seconds a structured output spec may take to compile (else the "
                                                  "request is a 400)")
    grammar_workers: int = option(2, "processes compiling structured output specs, per tokenizer replica")
    grammar_max_bytes: int = option(MAX_BYTES, "largest compiled grammar (serialized) a request may carry to the "
                                               "executor (which deserializes it once per spec: about 30 ms a MiB)")


class _Answer(msgspec.Struct, array_like=True):
    compiled: str = ""  # serialize_json() of the compiled grammar, when it compiled
    error: str = ""


def _work(conn, info_json: str, max_bytes: int) -> None:
    """A worker process: compile each spec it is sent, answer the serialized form or an error."""
    import xgrammar as xgr

    from shared.structured_output import StructuredOutputError, compile_spec

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                   cache_enabled=False)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(StructuredOutput).decode
    _limit_heap(WORKER_HEAP_BYTES + 4 * max_bytes)
    too_big = (f"the compiled grammar is larger than the limit of {max_bytes} bytes (--grammar-max-bytes): "
               "simplify the schema")
    conn.send_bytes(b"")  # ready
    while True:
        try:
            spec = decode(conn.recv_bytes())
        except EOFError:
            return  # the stage is gone
        try:
            compiled = compile_spec(compiler, spec)
            # at least twice its memory size serialized: refuse what is clearly too big before serializing
            if 2 * compiled.memory_size_bytes > max_bytes:
                answer = _Answer(error=too_big)
            else:
                text = compiled.serialize_json()
                answer = _Answer(error=too_big) if len(text) > max_bytes else _Answer(compiled=text)
        except StructuredOutputError as exc:
            answer = _Answer(error=str(exc))
        except (MemoryError, RuntimeError):  # serializing past the heap limit: std::bad_alloc
            answer = _Answer(error=too_big)
        compiled = text = None
        conn.send_bytes(encode(answer))


def _limit_heap(extra: int) -> None:
    """Cap this process's data segment at what it uses now plus extra (Linux)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            data = int(f.read().split()[5]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_DATA, (data + extra, data + extra))
    except (OSError, ValueError, ImportError):
        pass  # not Linux: no cap


@dataclass
class _Job:
    spec: StructuredOutput
    waiters: list[str]
    queued_at: float
    deadline: float = 0.0  # set once a worker takes it


@dataclass
class _Worker:
    process: multiprocessing.Process
    conn: object
    ready: bool = False
    job: _Job | None = None


class GrammarPool:
    def __init__(self, info_json: str, workers: int = 2, timeout_s: float = 10.0, max_bytes: int = MAX_BYTES):
        self.info_json, self.size, self.timeout_s, self.max_bytes = info_json, max(1, workers), timeout_s, max_bytes
        self._ctx = multiprocessing.get_context("spawn")
        self._decode = msgspec.msgpack.Decoder(_Answer).decode
        self._workers: list[_Worker] = []
        self._queue: OrderedDict[StructuredOutput, _Job] = OrderedDict()
        self._jobs: dict[StructuredOutput, _Job] = {}  # queued or compiling
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._cache_bytes = 0
        self._done: list[tuple[str, str, str]] = []  # (request id, compiled, error) answered, not yet polled
        self._up_at: float | None = None  # since when every worker is up
        self.compiles = 0  # specs sent to a worker (the tests count them)
        self._failed_starts = 0
        self.broken = ""  # why workers cannot start, once FAILED_STARTS died before they were up

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, **kw) -> GrammarPool:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        return cls(info.serialize_json(), **kw)

    def fresh(self) -> GrammarPool:
        """A new pool like this one (no workers yet, empty cache)."""
        return GrammarPool(self.info_json, self.size, self.timeout_s, self.max_bytes)

    def start(self) -> None:
        """Spawn the workers (without waiting for them); submit does it when not done yet."""
        while len(self._workers) < self.size:
            self._workers.append(self._spawn())

    def _spawn(self) -> _Worker:
        mine, theirs = self._ctx.Pipe()
        process = self._ctx.Process(target=_work, args=(theirs, self.info_json, self.max_bytes),
                                    name="grammar-worker", daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, mine)

    def submit(self, request_id: str, spec: StructuredOutput) -> None:
        """Compile spec for request_id; its answer comes out of a later poll()."""
        if self.broken:
            self._done.append((request_id, "", self.broken))
            return
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            self._done.append((request_id, hit, ""))
            return
        job = self._jobs.get(spec)
        if job is not None:
            job.waiters.append(request_id)  # the same spec is on its way: share it
            return
        self._jobs[spec] = self._queue[spec] = _Job(spec, [request_id], time.monotonic())
        self.start()
        self._dispatch()

    def cancel(self, request_id: str) -> None:
        """The request was aborted: its answer is not wanted. A queued spec nobody waits for
        any more is dropped; one compiling goes on (its result is cached)."""
        for spec, job in list(self._jobs.items()):
            if request_id in job.waiters:
                job.waiters.remove(request_id)
                if not job.waiters and self._queue.pop(spec, None) is not None:
                    del self._jobs[spec]

    def fds(self) -> list[int]:
        """File descriptors readable when a worker has something to say (for the loop's poll)."""
        return [w.conn.fileno() for w in self._workers]

    @property
    def busy(self) -> bool:
        return bool(self._jobs or self._done)

    def poll(self) -> list[tuple[str, str, str]]:
        """(request id, compiled, error) for each request answered since the last call: compiled
        is the serialized grammar when error is ""."""
        now = time.monotonic()
        for w in list(self._workers):
            if not self.broken:
                self._check(w, now)
        self._expire_queued(now)
        self._dispatch()
        done, self._done = self._done, []
        return done

    def _check(self, w: _Worker, now: float) -> None:
        try:
            while w.conn.poll(0):
                data = w.conn.recv_bytes()
                if not w.ready:
                    w.ready, self._failed_starts = True, 0
                    continue
                job, w.job = w.job, None
                if job is not None:
                    answer = self._decode(data)
                    if not answer.error:
                        self._remember(job.spec, answer.compiled)
                    self._answer(job, answer.compiled, answer.error)
        except (EOFError, OSError):
            if not w.ready:
                self._failed_starts += 1
                if self._failed_starts >= FAILED_STARTS:
                    self._give_up("the grammar compiler processes exit as they start (see the log): "
                                  "structured output is unavailable")
                    return
            self._replace(w, "the grammar compiler process died (out of memory?) compiling this spec")
            return
        if w.job is not None and now > w.job.deadline:
            log.warning("grammar compile of a %s spec ran past %.1f s: worker killed", w.job.spec.kind,
                        self.timeout_s)
            self._replace(w, self._too_slow())

    def _too_slow(self) -> str:
        return (f"the structured output spec did not compile within {self.timeout_s:g} s "
                "(--grammar-compile-timeout): simplify the schema")

    def _replace(self, w: _Worker, error: str) -> None:
        w.process.kill()
        w.process.join(timeout=1)
        w.conn.close()
        if w.job is not None:
            self._answer(w.job, "", error)
        self._workers[self._workers.index(w)] = self._spawn()

    def _give_up(self, why: str) -> None:
        log.error("%s", why)
        self.broken = why
        self.close()
        for job in list(self._jobs.values()):
            self._answer(job, "", why)
        self._queue.clear()

    def _expire_queued(self, now: float) -> None:
        if not all(w.ready for w in self._workers):
            self._up_at = None
            return  # a worker is starting (seconds): the queue waits for it
        self._up_at = self._up_at or now
        for spec, job in list(self._queue.items()):
            if now - max(job.queued_at, self._up_at) > self.timeout_s:
                del self._queue[spec]
                self._answer(job, "", self._too_slow())

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.ready and w.job is None:
                spec, job = self._queue.popitem(last=False)
                try:
                    w.conn.send_bytes(msgspec.msgpack.encode(spec))
                except OSError:  # it died since: the next poll replaces it
                    self._queue[spec] = job
                    self._queue.move_to_end(spec, last=False)
                    continue
                job.deadline = time.monotonic() + self.timeout_s
                w.job = job
                self.compiles += 1

    def _answer(self, job: _Job, compiled: str, error: str) -> None:
        self._jobs.pop(job.spec, None)
        self._done.extend((rid, compiled, error) for rid in job.waiters)

    def _remember(self, spec: StructuredOutput, compiled: str) -> None:
        self._cache[spec] = compiled
        self._cache_bytes += len(compiled)
        while len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_BYTES:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old)

    def close(self) -> None:
        for w in self._workers:
            w.process.kill()
            w.process.join(timeout=1)
            w.conn.close()
        self._workers = []
