"""``host:port`` addresses of RPC servers, IPv6 hosts in brackets (``[::1]:5000``)."""

from __future__ import annotations

from stead.core.errors import ConfigError

__all__ = ["format_address", "parse_address"]


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` from ``host:port`` or ``[ipv6]:port``; ConfigError when malformed."""
    hint = "pass host:port, e.g. 127.0.0.1:5000 or [::1]:5000"
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"address {address!r} is ambiguous: write an IPv6 host in brackets; {hint}")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"address {address!r} is not host:port; {hint}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ConfigError(f"address {address!r} has port {port}, outside 1-65535; {hint}")
    return host, port
