"""Errors of the NIXL transport, and the one place NIXL's exceptions become them.

NIXL raises its own exception types with terse messages; :func:`wrap` turns
them into a :class:`NixlError` naming the operation, the remote agent and a hint
at the likely cause, so a failed read says what to look at.
"""

from __future__ import annotations

__all__ = ["NixlAgentReset", "NixlError", "NixlKilledByReset", "NixlTimeout", "wrap"]


class NixlError(Exception):
    """A NIXL call failed; the message names the operation and the remote agent."""

    def __init__(self, message: str, *, remote: str | None = None) -> None:
        super().__init__(message)
        self.remote = remote


class NixlTimeout(NixlError):
    """A read passed its deadline (the peer is stalled or unreachable); reported
    only after the agent was reset, so nothing of it lands any more."""


class NixlAgentReset(NixlError):
    """A read named a link made before the agent was reset; nothing was posted."""


class NixlKilledByReset(NixlError):
    """A read was in flight on an agent that *another* read's failure reset: it
    posted, but died with the agent, so nothing of it lands any more. Its own
    links are of the old generation; the reader may retry it over fresh ones
    (unlike the read that caused the reset, nothing says its peer is bad)."""


_HINTS = {
    "nixlNotFoundError": "unknown agent, or an address range outside every region registered "
                         "by this agent or the remote",
    "nixlInvalidParamError": "descriptor lists differ in count or in a length",
    "nixlRemoteDisconnectError": "the remote agent disconnected (process gone?)",
    "nixlMismatchError": "metadata could not be parsed",
}


def wrap(what: str, exc: BaseException, remote: str | None) -> NixlError:
    kind = type(exc).__name__
    hint = _HINTS.get(kind)
    detail = f"{kind}: {exc}" + (f" ({hint})" if hint else "")
    return NixlError(f"{what} failed: {detail}", remote=remote)
