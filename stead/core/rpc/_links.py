"""The master's connections: how many it holds, which it lets go first, and when one has waited too long.

Every connection the RPC server accepts is a :class:`Link`. :class:`Links` keeps them:

- a connection that made no authenticated call within ``auth_timeout_s`` of opening is closed, with a call open
  or not (a client that holds the job token makes its first call as soon as it connects, and it passes the token
  check at once: an unauthenticated call still open is one whose answer its peer does not read);
- an authenticated connection with no call open for ``idle_timeout_s`` is closed (an agent always has its
  command stream open, so only a client that went quiet is let go; its next call connects again);
- at ``max_connections``, a new connection sheds the oldest unauthenticated one (one with no call open first),
  else the authenticated one idle the longest; when every connection is authenticated and has a call open, the
  newcomer is refused.

It knows nothing of grpclib: the server (:mod:`.server`) hands each link a way to close its connection and to
tell whether a call is open on it. One timer per link, armed on the event loop, looks at it when it could
next be due; calls starting and ending only update two fields.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import structlog

__all__ = ["Link", "Links"]

log = structlog.get_logger()

#: a server that sheds or refuses connections logs it at most this often (a storm is a line a second, counted)
_LOG_EVERY_S = 1.0
_HINT_LIMIT = ("unauthenticated connections are let go first; if the job's own clients are refused, raise "
               "rpc_max_connections (and the master's open-files limit)")


class Link:
    """One accepted connection, as the server sees it."""

    __slots__ = ("_busy", "_close", "authenticated", "last_active", "opened_at", "peer", "timer")

    def __init__(self, *, close: Callable[[str], None], busy: Callable[[], bool], peer: str, now: float) -> None:
        self._close = close
        self._busy = busy
        #: what looks at it next (see :meth:`Links._look`)
        self.timer: asyncio.TimerHandle | None = None
        self.peer = peer
        self.opened_at = now
        #: when a call on it last started or ended
        self.last_active = now
        #: a call on it passed the token check
        self.authenticated = False

    @property
    def busy(self) -> bool:
        """A call is open on it (a unary call in progress, or a stream)."""
        return self._busy()

    def close(self, reason: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._close(reason)


class Links:
    """The open connections of one server, with the limit and the timeouts applied to them."""

    def __init__(self, *, max_connections: int, idle_timeout_s: float, auth_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self._clock = clock
        self._open: dict[Link, None] = {}
        #: the connections that made no authenticated call yet, oldest first
        self._unauthenticated: dict[Link, None] = {}
        self._logged = -math.inf
        #: connections closed to make room for newer ones, newcomers refused, and connections let go because their
        #: peer read nothing of what it was sent, so far
        self.shed = 0
        self.refused = 0
        self.cut_off = 0

    def __len__(self) -> int:
        return len(self._open)

    def now(self) -> float:
        return self._clock()

    def admit(self, link: Link) -> bool:
        """Take a new connection in, shedding another at the limit; False: it is refused (the caller closes it)."""
        if len(self._open) >= self.max_connections:
            victim = (next((old for old in self._unauthenticated if not old.busy), None)
                      or next(iter(self._unauthenticated), None) or self._idlest())
            if victim is None:
                self.refused += 1
                self._log_pressure("rpc_connection_refused", peer=link.peer)
                return False
            self.shed += 1
            self._log_pressure("rpc_connection_shed", peer=victim.peer, authenticated=victim.authenticated)
            self.gone(victim)
            victim.close(f"this master holds its limit of {self.max_connections} connections "
                         "(setting rpc_max_connections) and let an unused one go")
        self._open[link] = None
        self._unauthenticated[link] = None
        self._arm(link, link.opened_at + self.auth_timeout_s)
        return True

    def authenticated(self, link: Link) -> None:
        """A call on ``link`` passed the token check."""
        link.last_active = self._clock()
        if not link.authenticated:
            link.authenticated = True
            self._unauthenticated.pop(link, None)

    def active(self, link: Link) -> None:
        """A call on ``link`` started or ended."""
        link.last_active = self._clock()

    def gone(self, link: Link) -> None:
        """``link`` is closed (by either side): forget it."""
        self._open.pop(link, None)
        self._unauthenticated.pop(link, None)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None

    def cut(self, link: Link, *, buffered: int) -> None:
        """``link``'s peer reads nothing of what it is sent, and the server lets it go (the caller closes it)."""
        self.cut_off += 1
        self._log_pressure("rpc_connection_cut", peer=link.peer, authenticated=link.authenticated,
                           buffered_bytes=buffered, cut_off=self.cut_off,
                           hint="a client that sends and never reads what it is answered (PINGs, SETTINGS): if it "
                                "is the job's own, see why it stopped reading")
        self.gone(link)

    def close_all(self, reason: str) -> None:
        for link in list(self._open):
            self.gone(link)
            link.close(reason)

    def _idlest(self) -> Link | None:
        """The authenticated connection with no call open that was active the longest ago (a scan: only at
        the limit with no unauthenticated connection to shed)."""
        idle = [link for link in self._open if not link.busy]
        return min(idle, key=lambda link: link.last_active, default=None)

    def _arm(self, link: Link, at: float) -> None:
        loop = asyncio.get_running_loop()
        link.timer = loop.call_later(max(0.0, at - self._clock()), self._look, link)

    def _look(self, link: Link) -> None:
        """The link's timer: close it if it is due, else look again when it next could be."""
        link.timer = None
        if link not in self._open:
            return
        now = self._clock()
        if link.authenticated and link.busy:  # a call is open, such as an agent's command stream: look again later
            self._arm(link, now + self.idle_timeout_s)
            return
        if not link.authenticated:
            due, reason = link.opened_at + self.auth_timeout_s, (
                f"no authenticated call within {self.auth_timeout_s:g} s of connecting (setting "
                "rpc_auth_timeout_s): call with the job's token right after connecting")
        else:
            due, reason = link.last_active + self.idle_timeout_s, (
                f"no call for {self.idle_timeout_s:g} s (setting rpc_idle_timeout_s); the next call connects again")
        if now < due:
            self._arm(link, due)
            return
        log.debug("rpc_connection_closed", peer=link.peer, authenticated=link.authenticated, reason=reason)
        self.gone(link)
        link.close(reason)

    def _log_pressure(self, event: str, hint: str = _HINT_LIMIT, **fields: object) -> None:
        now = self._clock()
        if now - self._logged < _LOG_EVERY_S:
            return
        self._logged = now
        log.warning(event, connections=len(self._open), max_connections=self.max_connections, shed=self.shed,
                    refused=self.refused, **fields, hint=hint)
