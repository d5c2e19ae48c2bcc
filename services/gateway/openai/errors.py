"""The OpenAI-style error: an ApiError raised anywhere in parsing renders as
`{"error": {"message", "type", "param", "code"}}` with its HTTP status (400 unless said)."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.error_type, self.code = (
            message, status, param, error_type, code,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        }


def type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def wrong_type(name: str, expected: str, value) -> ApiError:
    return ApiError(f"'{name}' must be {expected}, not {type_name(value)}.", param=name)


def too_long(name: str, what: str, limit: int, param: str) -> ApiError:
    return ApiError(f"'{name}': the {what} is longer than {limit} characters.", param=param)
