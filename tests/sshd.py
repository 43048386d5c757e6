"""A throwaway sshd on loopback addresses, so multi-host code really goes through ssh.

Each address in HOSTS plays one board. 127.0.0.1 is left out on purpose:
horovodrun treats any address of a local interface as "local" and starts those
ranks without ssh, while 127.0.0.2/3 are routed to `lo` but are not interface
addresses, so horovodrun must ssh to them. Nothing here touches the real
~/.ssh: keys, known_hosts, the remote HOME and the client config all live in
a temp folder, and an `ssh` wrapper first on PATH points every ssh call (from
horovodrun, rsync, ssh-copy-id, the cluster scripts) at that client config.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HOSTS = ("127.0.0.2", "127.0.0.3")
SSHD = shutil.which("sshd", path="/usr/sbin:/usr/local/sbin:/sbin") or ""
SSH = shutil.which("ssh") or ""

_CONNECTION = re.compile(r"Connection from \S+ port (\d+) on (\S+) port \d+")
_ACCEPTED = re.compile(r"Accepted publickey for \S+ from \S+ port (\d+)")


@dataclass
class LoopbackSshd:
    root: Path
    hosts: tuple[str, ...]
    port: int
    identity: Path  # client key authorized on every "host"
    home: Path  # the remote sessions' HOME
    process: subprocess.Popen

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def log(self) -> Path:
        return self.root / "sshd.log"

    @property
    def authorized_keys(self) -> Path:
        return self.home / ".ssh" / "authorized_keys"

    def env(self) -> dict[str, str]:
        """Environment for a process whose ssh calls should use this sshd's client config."""
        return {**os.environ, "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def ssh_args(self) -> list[str]:
        """What horovodrun and the cluster scripts take to reach these hosts."""
        return ["--ssh-port", str(self.port), "--ssh-identity-file", str(self.identity)]

    def logins(self) -> Counter:
        """Accepted public-key logins per destination address, read from sshd's own log."""
        destination_by_port: dict[str, str] = {}
        logins: Counter = Counter()
        for line in self.log.read_text().splitlines():
            if match := _CONNECTION.search(line):
                destination_by_port[match.group(1)] = match.group(2)
            elif match := _ACCEPTED.search(line):
                logins[destination_by_port.get(match.group(1), "?")] += 1
        return logins

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "covidxray-test", "-f", str(path)], check=True)
    return path


def _wait_listening(
    hosts: tuple[str, ...], port: int, process: subprocess.Popen, log: Path, timeout: float = 15
) -> None:
    deadline = time.monotonic() + timeout
    pending = set(hosts)
    while pending and time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited with {process.returncode}: {log.read_text() if log.exists() else ''}")
        for host in list(pending):
            try:
                socket.create_connection((host, port), timeout=1).close()
                pending.discard(host)
            except OSError:
                pass
        time.sleep(0.1)
    if pending:
        raise RuntimeError(f"sshd not listening on {sorted(pending)} port {port}")


def start_sshd(root: Path, hosts: tuple[str, ...] = HOSTS) -> LoopbackSshd:
    root.mkdir(parents=True, exist_ok=True)
    home = root / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700, exist_ok=True)
    host_key = _keygen(root / "host_key")
    identity = _keygen(root / "id_ed25519")
    shutil.copy(identity.with_suffix(".pub"), home / ".ssh" / "authorized_keys")
    port = _free_port(hosts[0])
    use_pam = (
        "yes" if Path("/etc/pam.d/sshd").is_file() else "no"
    )  # without PAM, sshd refuses accounts with a locked password
    (root / "sshd_config").write_text(
        "".join(f"ListenAddress {host}:{port}\n" for host in hosts)
        + f"HostKey {host_key}\nPidFile {root / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {home / '.ssh' / 'authorized_keys'}\n"
        "PermitRootLogin yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"UsePAM {use_pam}\nStrictModes no\nLogLevel VERBOSE\nMaxStartups 100\nMaxSessions 100\n"
        f"SetEnv HOME={home}\n"
    )
    (root / "ssh_config").write_text(
        f"Host *\n  UserKnownHostsFile {root / 'known_hosts'}\n  StrictHostKeyChecking accept-new\n"
        "  BatchMode yes\n  IdentitiesOnly yes\n  LogLevel ERROR\n"
    )
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {SSH} -F {root / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir sshd insists on as root
    log = root / "sshd.log"
    process = subprocess.Popen([SSHD, "-D", "-f", str(root / "sshd_config"), "-E", str(log)])
    _wait_listening(hosts, port, process, log)
    return LoopbackSshd(root=root, hosts=hosts, port=port, identity=identity, home=home, process=process)
