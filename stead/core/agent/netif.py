"""The network interface the workers' collectives use when the user chose none: the one that reaches the master.

gloo and NCCL pick an interface of their own (gloo: the one the host name resolves to; NCCL: the first that is
not loopback or docker), which on a machine with several (a management network beside the training one, a
container bridge) is often not the one the other hosts reach. torchrun leaves that to the user, through
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``. When neither is set and the job's master is on another host,
the agent gives its workers the interface it reaches the master from itself, and says so in its log.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

import psutil

from stead.core.rpc.address import parse_address

__all__ = ["IFNAME_VARIABLES", "interface_env", "interface_toward"]

#: what the user sets to choose the workers' interface themselves (either one leaves the choice to them)
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_toward(host: str, port: int) -> tuple[str, str] | None:
    """``(interface, local address)`` this machine reaches ``host:port`` from; None when unknown. No packet is
    sent: a UDP socket's connect only asks the kernel for the route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        address = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)[0][4]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            local = str(probe.getsockname()[0])
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name, local
    return None


def interface_env(environ: Mapping[str, str], master_address: str) -> tuple[dict[str, str], str]:
    """The variables that give the workers the interface toward ``master_address`` (none when the user set one,
    or the master is on this machine), and the interface's name ("" when none is chosen)."""
    if any(environ.get(name) for name in IFNAME_VARIABLES):
        return {}, ""
    host, port = parse_address(master_address)
    found = interface_toward(host, port)
    if found is None or ipaddress.ip_address(found[1]).is_loopback:
        return {}, ""
    name = found[0]
    return {variable: name for variable in IFNAME_VARIABLES}, name
