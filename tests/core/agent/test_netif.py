"""The interface the workers get when the user chose none: the one toward the master, never loopback."""

from __future__ import annotations

from stead.core.agent.netif import interface_env, interface_toward


def test_a_master_on_this_machine_or_an_interface_the_user_chose_leaves_the_workers_as_they_are() -> None:
    assert interface_env({}, "127.0.0.1:5000") == ({}, "")
    assert interface_env({"NCCL_SOCKET_IFNAME": "ib0"}, "10.77.0.1:29400") == ({}, "")
    assert interface_env({"GLOO_SOCKET_IFNAME": "eth1"}, "10.77.0.1:29400") == ({}, "")


def test_the_interface_toward_an_address_is_the_one_holding_the_local_address() -> None:
    found = interface_toward("127.0.0.1", 9)
    assert found is not None and found[1] == "127.0.0.1" and found[0]  # ("lo", "127.0.0.1") on Linux
    assert interface_toward("host.invalid", 9) is None  # a name that does not resolve: unknown, not an error
