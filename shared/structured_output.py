"""Structured output specs compiled with xgrammar (the grammar engine vLLM and SGLang use).

The tokenizer stage compiles each spec (in worker processes with a time limit,
`services.tokenizer.grammar_pool`, through `compile_spec`), so that a bad or too costly
schema, regex or grammar is a 400 before the request runs, and the request carries the
compiled grammar on in its serialized form (`CompiledGrammar.serialize_json`). The
executor's `GrammarCompilerCache.get` deserializes that form (about 1 ms, cached by spec),
after checking it was made for the executor's vocabulary; it compiles only a spec that
came without it (a request built without the tokenizer stage) or whose compiled form does
not fit (a tokenizer replica of another model), and logs it. JSON is compiled without
free whitespace (compact separators), so a constrained answer never wanders off into
spaces and always parses once complete, and with its numbers held to what a float64 or an
int64 holds (shared.json_grammar; a spec's `unbounded_numbers` keeps xgrammar's own), so a
model cannot repeat a digit until max_tokens. xgrammar is an optional dependency
(`pip install 'pagedserve[structured]'`); without it a constrained request is refused.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

from shared.json_grammar import bounded_json_grammar
from shared.messages import StructuredOutput

log = logging.getLogger(__name__)

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


class StructuredOutputError(ValueError):
    """The spec cannot be compiled (a bad schema, regex or grammar), or its compiled form
    does not fit this vocabulary."""


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _choice_grammar(spec: str) -> str:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def compile_spec(compiler, spec: StructuredOutput):
    """spec compiled by an xgrammar GrammarCompiler; StructuredOutputError when it cannot be."""
    try:
        if spec.kind in ("json", "json_schema"):
            schema = spec.spec if spec.kind == "json_schema" else '{"type": "object"}'
            if spec.unbounded_numbers:
                return compiler.compile_json_schema(schema, any_whitespace=False)
            return compiler.compile_grammar(bounded_json_grammar(schema))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            return compiler.compile_grammar(_choice_grammar(spec.spec))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.spec)
    except StructuredOutputError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
        raise StructuredOutputError(f"{spec.kind} cannot be compiled: {_why(exc)}") from exc
    raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")


def _why(exc: Exception) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])  # drop xgrammar's time and source file


class GrammarCompilerCache:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = self.loads = 0  # counted for the tests

    def get(self, spec: StructuredOutput, compiled: str = ""):
        """The compiled grammar of spec: from the cache, else deserialized from compiled (the
        tokenizer stage's serialize_json), else compiled here: when compiled is missing, or
        was made for another vocabulary (logged). StructuredOutputError when spec does not
        compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = None
        if compiled:
            try:
                grammar = self._load(spec, compiled)
            except StructuredOutputError as exc:
                log.warning("%s; compiling it here instead", exc)
        else:
            log.warning("a %s spec came without its compiled form: compiling it here", spec.kind)
        if grammar is None:
            grammar = self._compile(spec)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    compile = get  # a spec alone is compiled (and cached)

    def _load(self, spec: StructuredOutput, compiled: str):
        self.loads += 1
        try:
            grammar = self.xgr.CompiledGrammar.deserialize_json(compiled, self.info)
        except Exception as exc:  # DeserializeFormatError (another vocabulary), InvalidJSONError
            raise StructuredOutputError(f"the compiled {spec.kind} grammar does not fit this model: "
                                        f"{_why(exc)}") from exc
        if grammar.tokenizer_info.vocab_size != self.info.vocab_size:
            raise StructuredOutputError(f"the compiled {spec.kind} grammar is for a vocabulary of "
                                        f"{grammar.tokenizer_info.vocab_size}, not {self.info.vocab_size}")
        return grammar

    def _compile(self, spec: StructuredOutput):
        self.compiles += 1
        return compile_spec(self.compiler, spec)
