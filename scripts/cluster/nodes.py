"""What the cluster scripts share: the hostfile, rank placement, and running commands on boards over ssh.

The hostfile is read with Horovod's own parser and ranks are placed with
Horovod's own assignment, so these scripts see exactly the cluster that
`horovodrun --hostfile` will launch. ssh flags mirror horovodrun's
(--ssh-port, --ssh-identity-file) so one set of values serves both.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from horovod.runner.common.util.hosts import HostInfo, SlotInfo, get_host_assignments, parse_host_files, parse_hosts
from horovod.runner.util.network import filter_local_addresses

T = TypeVar("T")
R = TypeVar("R")


class ClusterError(Exception):
    """A problem the user fixes (bad hostfile, unreachable board); printed without a traceback."""


def read_hostfile(path: Path) -> list[HostInfo]:
    if not path.is_file():
        raise ClusterError(f"{path}: no such hostfile; write one with scripts/cluster/make_hostfile.py")
    try:
        hosts = parse_hosts(parse_host_files(str(path)))
    except (IndexError, ValueError) as err:
        raise ClusterError(
            f"{path}: every line must be '<host> slots=<n>' ({err}); regenerate it with make_hostfile.py"
        ) from None
    if not hosts:
        raise ClusterError(f"{path}: no hosts listed")
    return hosts


def place_ranks(hosts: list[HostInfo], num_proc: int | None = None) -> list[SlotInfo]:
    """Rank -> host exactly as horovodrun assigns them (fills each host's slots in hostfile order)."""
    total = sum(h.slots for h in hosts)
    num_proc = num_proc or total
    try:
        return get_host_assignments(hosts, num_proc, num_proc)
    except ValueError as err:
        raise ClusterError(str(err)) from None


def local_hosts(names: Iterable[str]) -> set[str]:
    """Names horovodrun starts without ssh (they resolve to an address of this machine)."""
    names = list(names)
    return set(names) - set(filter_local_addresses(names))


@dataclass(frozen=True)
class Ssh:
    port: int | None = None
    identity_file: str | None = None
    connect_timeout: int = 10

    def options(self) -> list[str]:
        opts = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout}"]
        if self.port:
            opts += ["-p", str(self.port)]
        if self.identity_file:
            opts += ["-i", self.identity_file]
        return opts

    def command(self, host: str, remote: str) -> list[str]:
        return ["ssh", *self.options(), host, remote]

    def run(self, host: str, remote: str, local: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
        """`remote` (a shell command) on `host`; on the launcher itself without ssh, as horovodrun does."""
        command = ["sh", "-c", remote] if local else self.command(host, remote)
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(command, 255, "", f"{host}: no answer within {timeout:.0f}s")

    def rsync_shell(self) -> str:
        """The `-e` value that makes rsync use the same ssh settings."""
        return shlex.join(["ssh", *self.options()])


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hostfile", type=Path, required=True, help="'<host> slots=<n>' per line (make_hostfile.py writes it)."
    )
    parser.add_argument("--ssh-port", type=int, default=None, help="As horovodrun --ssh-port.")
    parser.add_argument("--ssh-identity-file", default=None, help="As horovodrun --ssh-identity-file.")


def ssh_from_args(args: argparse.Namespace) -> Ssh:
    return Ssh(port=args.ssh_port, identity_file=args.ssh_identity_file)


def on_every_host(action: Callable[[T], R], hosts: Iterable[T], parallel: int = 16) -> list[R]:
    """Run `action` for each host concurrently (35 boards one after another is slow), keeping input order."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(action, hosts))


def main_guard(main: Callable[[], int]) -> None:
    """Exit with main's code; a ClusterError prints one line and exits 2."""
    try:
        sys.exit(main())
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
