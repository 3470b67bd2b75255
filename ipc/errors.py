"""The exceptions the engine clients raise, one per wire error code.

Every refusal or failure the daemon answers with an :class:`~.protocol.Error`
reply surfaces as a :class:`SidecarError` subclass chosen by its ``code``
(:func:`error_from_reply`); a code this client does not know surfaces as the
base class, so a newer daemon's codes still reach the caller. No reply in
time is :class:`SidecarTimeout`. :func:`expect` is how a client checks a
reply: the kind it asked for, or the error it is raised.
"""

from __future__ import annotations

from typing import TypeVar

from .protocol import (
    BAD_MESSAGE,
    BAD_REQUEST,
    DUPLICATE,
    FORBIDDEN,
    INCOMPATIBLE,
    INTERNAL,
    UNAVAILABLE,
    UNKNOWN_ENGINE,
    VERSION,
    Error,
    Reply,
)

__all__ = [
    "BadMessage",
    "BadRequest",
    "Duplicate",
    "Forbidden",
    "Incompatible",
    "InternalError",
    "SidecarError",
    "SidecarTimeout",
    "Unavailable",
    "UnknownEngine",
    "VersionMismatch",
    "error_from_reply",
    "expect",
]

R = TypeVar("R", bound=Reply)


class SidecarError(Exception):
    """The daemon refused or failed a request; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class BadMessage(SidecarError):
    """The daemon could not parse what this client sent (a client bug)."""


class VersionMismatch(SidecarError):
    """Client and daemon speak different protocol versions."""


class UnknownEngine(SidecarError):
    """The engine id is not registered (never, or the daemon restarted)."""


class BadRequest(SidecarError):
    """Well-formed but unacceptable (block ids out of range, wrong sizes...)."""


class Duplicate(SidecarError):
    """The engine or request id is already in use."""


class Incompatible(SidecarError):
    """The remote engine's layout describes a different model."""


class Unavailable(SidecarError):
    """The daemon cannot serve this now (peer unreachable, shutting down...)."""


class InternalError(SidecarError):
    """A bug in the daemon; the message carries the exception text."""


class Forbidden(SidecarError):
    """This process's uid/gid may not use the sidecar (its ``--allow-uid``/``--allow-gid``)."""


class SidecarTimeout(SidecarError):
    """No reply in time: the daemon is not running, stuck, or the socket path is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)


_ERRORS: dict[str, type[SidecarError]] = {
    BAD_MESSAGE: BadMessage,
    VERSION: VersionMismatch,
    UNKNOWN_ENGINE: UnknownEngine,
    BAD_REQUEST: BadRequest,
    DUPLICATE: Duplicate,
    INCOMPATIBLE: Incompatible,
    UNAVAILABLE: Unavailable,
    INTERNAL: InternalError,
    FORBIDDEN: Forbidden,
}


def error_from_reply(err: Error) -> SidecarError:
    """The typed exception for an error reply (the base class for codes this
    client does not know, so a newer daemon's codes still surface)."""
    return _ERRORS.get(err.code, SidecarError)(err.code, err.message)


def expect(reply: Reply, kind: type[R]) -> R:
    """``reply`` if it is a ``kind``; else the error it is (or is not: a reply of
    another kind is a :class:`BadMessage`) raised. The expected kind is tested
    first: ``isinstance`` of the exact class is immediate, while a miss on a
    msgspec Struct costs ~2 µs on a cold cache."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Error):
        raise error_from_reply(reply)
    got = type(reply).__name__
    raise BadMessage(BAD_MESSAGE, f"expected a {kind.__name__} reply, got {got}")
