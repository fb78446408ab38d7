"""The connection table's rules on links whose calls never finish: an unauthenticated one goes at its deadline, and
at the limit before a newcomer is refused."""

from __future__ import annotations

import pytest
from _polling import until

from stead.core.rpc import Link, Links

pytestmark = pytest.mark.anyio


class _Conn:
    """What the server hands a link: a way to close the connection, and whether a call is open on it."""

    def __init__(self, links: Links, *, busy: bool) -> None:
        self.busy = busy
        self.closed: str | None = None
        self.link = Link(close=self._close, busy=lambda: self.busy, peer="peer", now=links.now())

    def _close(self, reason: str) -> None:
        self.closed = reason


async def test_an_unauthenticated_connection_whose_call_never_finishes_is_closed_at_its_auth_deadline() -> None:
    # a rejected call whose answer its peer never reads stays open: it used to keep the connection for ever
    links = Links(max_connections=10, idle_timeout_s=600, auth_timeout_s=0.05)
    stuck, agent = _Conn(links, busy=True), _Conn(links, busy=True)
    assert links.admit(stuck.link) and links.admit(agent.link)
    links.authenticated(agent.link)  # an agent's command stream: open for as long as it lives
    await until(lambda: stuck.closed is not None, "the table's auth deadline closed the stuck connection")
    assert "no authenticated call within 0.05 s of connecting (setting rpc_auth_timeout_s)" in stuck.closed
    assert agent.closed is None and len(links) == 1


async def test_at_the_limit_an_unauthenticated_connection_with_a_call_open_makes_room_for_a_newcomer() -> None:
    links = Links(max_connections=2, idle_timeout_s=600, auth_timeout_s=600)
    agent, stuck = _Conn(links, busy=True), _Conn(links, busy=True)
    assert links.admit(agent.link) and links.admit(stuck.link)
    links.authenticated(agent.link)
    newcomer = _Conn(links, busy=False)
    assert links.admit(newcomer.link), "a real client was refused while a stranger's stuck call held a slot"
    assert stuck.closed is not None and "rpc_max_connections" in stuck.closed
    assert agent.closed is None and links.shed == 1
    late = _Conn(links, busy=False)
    links.authenticated(newcomer.link)
    newcomer.busy = True
    assert not links.admit(late.link)  # every connection authenticated with a call open: the newcomer is refused
    assert links.refused == 1
    links.close_all("done")
