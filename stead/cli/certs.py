"""`stead certs`: a per-job certificate authority and the one certificate every host of the job uses for mutual TLS.

The certificate is valid as server (the master's) and as client (agents, spares,
workers, `stead scale`), with a SAN for each host name or address the master may be
reached by. The files go into one directory, keys readable by their owner only;
nothing there is overwritten without ``--force``. The output says which settings
to give on every host.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import shlex
import socket
from collections.abc import Sequence
from pathlib import Path

from stead.core.errors import ConfigError

__all__ = ["add_certs_parser", "default_hosts", "make_certs"]

#: the files `stead certs` writes into its directory, by what they hold
CA_CERT, CA_KEY, HOST_CERT, HOST_KEY = "ca.pem", "ca-key.pem", "host.pem", "host-key.pem"
#: how long the certificates are valid unless --days says otherwise
DEFAULT_DAYS = 365


def add_certs_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    c = sub.add_parser(
        "certs", help="make a job's certificate authority and certificate for mutual TLS between hosts",
        description="Make a certificate authority for one job (ca.pem, and ca-key.pem, which signs: keep it "
        "private) and one certificate signed by it (host.pem, host-key.pem) that every host of the job uses as "
        "server and as client, valid for the --host names and addresses. Keys are written mode 0600; existing "
        "files are kept unless --force. Copy the directory to every host (or share it), then give each `stead` "
        "command the settings printed at the end: tls_ca_file, tls_cert_file and tls_key_file (all three or "
        "none). A peer whose certificate another CA signed, or that has none, is refused; the job token is "
        "still checked on top.")
    c.add_argument("--job", required=True, help="the job's name (in the CA's and the certificate's names)")
    c.add_argument("--dir", required=True, metavar="DIR", help="where to write the files (made if missing)")
    c.add_argument("--host", dest="hosts", action="append", default=[], metavar="NAME_OR_IP",
                   help="a host name or IP address the master may be reached by (repeatable; give every host "
                   "that may serve it). Default: this machine's host names, its addresses, localhost, 127.0.0.1")
    c.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"days the certificates are valid "
                   f"(default: {DEFAULT_DAYS})")
    c.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    return c


def default_hosts() -> list[str]:
    """This machine's host names and addresses, localhost and 127.0.0.1: what a master here is reached by."""
    names = [socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    names += [str(info[4][0]) for info in infos]
    try:
        import psutil

        names += [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family in (socket.AF_INET, socket.AF_INET6) and "%" not in a.address]
    except (ImportError, OSError):
        pass
    return list(dict.fromkeys(n for n in names if n))


def make_certs(*, job: str, directory: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS,
               force: bool = False) -> dict[str, Path]:
    """Write the CA and the host certificate into ``directory``; returns the three settings' values."""
    from stead.core.certs import Authority, write_private

    if days < 1:
        raise ConfigError(f"--days {days}: certificates must be valid for at least one day")
    for host in hosts:
        _check_host(host)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    files = {name: directory / name for name in (CA_CERT, CA_KEY, HOST_CERT, HOST_KEY)}
    there = [str(path) for path in files.values() if path.exists()]
    if there and not force:
        raise ConfigError(f"{', '.join(there)} exist already; a new CA would make every host's certificate of the "
                          "old one useless: use another --dir, or pass --force to replace them")
    authority = Authority(f"stead job {job}", valid=datetime.timedelta(days=days))
    issued = authority.issue(f"stead job {job}", server=True, client=True, hosts=hosts)
    write_private(files[CA_KEY], authority.own.key_pem)
    write_private(files[HOST_KEY], issued.key_pem)
    files[CA_CERT].write_bytes(authority.own.cert_pem)
    files[HOST_CERT].write_bytes(issued.cert_pem)
    return {"tls_ca_file": files[CA_CERT].resolve(), "tls_cert_file": files[HOST_CERT].resolve(),
            "tls_key_file": files[HOST_KEY].resolve()}


def _check_host(host: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or any(not label or len(label) > 63 or not all(c.isalnum() or c in "-_*" for c in label)
                       for label in labels):
        raise ConfigError(f"--host {host!r} is neither an IP address nor a host name; give the name or address "
                          "agents dial the master by")


def run_certs(args: argparse.Namespace) -> int:
    hosts = list(dict.fromkeys(args.hosts)) or default_hosts()
    settings = make_certs(job=args.job, directory=Path(args.dir), hosts=hosts, days=args.days, force=args.force)
    print(f"wrote a CA and a certificate for job {args.job!r} into {args.dir}, valid {args.days} days for: "
          f"{', '.join(hosts)}")
    print(f"keep {CA_KEY} private (it signs); copy {CA_CERT}, {HOST_CERT} and {HOST_KEY} to every host at the same "
          "paths, and give every `stead` command of the job (run, agent, scale) these settings:")
    print(" ".join(f"--set {name}={shlex.quote(str(path))}" for name, path in settings.items()))
    print("or in the environment:")
    for name, path in settings.items():
        print(f"export STEAD_{name.upper()}={shlex.quote(str(path))}")
    return 0
