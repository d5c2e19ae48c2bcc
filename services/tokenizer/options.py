"""The tokenizer stage's options: its replica name and its grammar compiler pool's
(grammar_pool.GrammarOptions); see shared.options."""

from __future__ import annotations

from dataclasses import dataclass

from services.tokenizer.grammar_pool import GrammarOptions
from shared.options import group, option


@dataclass(frozen=True)
class TokenizerOptions:
    """tokenizer"""

    replica: str | None = option(None, "this replica's name (default tokenizer-<host>-<pid>)", stage_only=True)
    grammar: GrammarOptions = group(GrammarOptions)
