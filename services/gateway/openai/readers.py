"""Typed readers of one body field: null means the default; a wrong type or range is an ApiError
naming the field."""

from __future__ import annotations

import math

from services.gateway.openai.errors import ApiError, wrong_type

INT64 = 2**63


def integer(body: dict, name: str, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(name, "an integer", value)
    if not -INT64 <= value < INT64:
        raise ApiError(f"'{name}' is out of range.", param=name)
    return value


def number(body: dict, name: str, default: float, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite number in [low, high]."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(name, "a number", value)
    try:
        result = float(value)
    except OverflowError:  # an integer too big for a float
        result = math.inf
    if not math.isfinite(result):
        raise ApiError(f"'{name}' must be a finite number.", param=name)
    if not low <= result <= high:
        raise ApiError(f"'{name}' must be between {low:g} and {high:g}, got {result:g}.", param=name)
    return result


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean", value)
    return value


def token_id_list(body: dict, name: str, limit: int, allow_empty: bool = True) -> list[int]:
    ids = body.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(is_token_id(t) for t in ids):
        raise wrong_type(name, "an array of token ids", ids)
    if not ids and not allow_empty:
        raise ApiError(f"'{name}' must not be empty.", param=name)
    if len(ids) > limit:
        raise ApiError(f"Too many {name}: {len(ids)}, at most {limit}.", param=name)
    return ids


def string_list(body: dict, name: str, expected: str, blank: bool = True) -> list[str]:
    """A string or an array of strings (not blank ones unless blank), as a list; [] for null."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and (blank or s.strip()) for s in value):
        raise wrong_type(name, expected, value)
    return value


def is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < INT64
