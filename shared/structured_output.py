"""Structured output specs compiled with xgrammar (the grammar engine vLLM and SGLang use).

Both the tokenizer stage (to refuse a bad schema, regex or grammar with a 400 before
the request runs) and the executor (to build the token masks) compile through
`GrammarCompilerCache`, against the model's tokenizer, caching by spec. JSON is
compiled without free whitespace (compact separators), so a constrained answer never
wanders off into spaces and always parses once complete. xgrammar is an optional
dependency (`pip install 'pagedserve[structured]'`); without it a constrained request
is refused.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from shared.messages import StructuredOutput

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


class StructuredOutputError(ValueError):
    """The spec cannot be compiled (a bad schema, regex or grammar)."""


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


class GrammarCompilerCache:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput):
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        c = self.compiler
        try:
            if spec.kind == "json":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                return c.compile_grammar(_choice_grammar(spec.spec))
            if spec.kind == "grammar":
                return c.compile_grammar(spec.spec)
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
            lines = str(exc).strip().splitlines() or [""]
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])  # drop xgrammar's time and source file
            raise StructuredOutputError(f"{spec.kind} cannot be compiled: {why}") from exc
        raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")
