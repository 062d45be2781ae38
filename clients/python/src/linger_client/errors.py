"""The errors the client raises: one base class, one subclass per cause."""

from __future__ import annotations


class LingerError(Exception):
    """Base class of every error this package raises."""


class ServerError(LingerError):
    """The server answered a request with an `error` frame (protocol section 4)."""

    def __init__(self, code: str, message: str, conversation_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.conversation_id = conversation_id


class ConnectionLost(LingerError):
    """The socket went away before the server answered a request that cannot
    be repeated safely (a `create`: it may or may not have happened)."""


class Unauthorized(LingerError):
    """The server refused the token (HTTP 401): retrying would not help."""


class ClientClosed(LingerError):
    """The client was closed by the application."""


class Detached(LingerError):
    """The server detached the conversation (user limit, close, delete,
    shutdown) while a message waited for its acknowledgement. Sending again
    attaches again, which resumes the conversation."""

    def __init__(self, conversation_id: str, reason: str) -> None:
        super().__init__(f"{conversation_id} was detached: {reason}")
        self.conversation_id = conversation_id
        self.reason = reason


class ReadOnly(LingerError):
    """A control request on a conversation opened in observe mode."""


class ToolError(Exception):
    """Raise from a tool-call handler to answer with `is_error: true` and
    this output (any JSON value)."""

    def __init__(self, output: object) -> None:
        super().__init__(str(output))
        self.output = output
