"""The tokenizer stage's options: its replica name, how it spreads requests over several
engines, and its grammar compiler pool's (grammar_pool.GrammarOptions); see shared.options."""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.engine_router import POLICIES
from services.tokenizer.grammar_pool import GrammarOptions
from shared.options import group, option


@dataclass(frozen=True)
class TokenizerOptions:
    """tokenizer"""

    replica: str | None = option(None, "this replica's name (default tokenizer-<host>-<pid>)", stage_only=True)
    routing: str = option("prefix", "with several engines: prefix-aware (with a load cap), least-loaded or "
                                    "round-robin", choices=POLICIES)
    grammar: GrammarOptions = group(GrammarOptions)
