"""The error a request is refused with."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with OpenAI's error object."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
        unread: bool = False,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.unread = unread  # refused before its body was read: the connection closes after the answer
