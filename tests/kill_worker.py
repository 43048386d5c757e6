"""Shared by the elastic tests (start a horovodrun job, SIGKILL one worker mid-training, let it finish) and the
decode-worker tests (decoders that kill themselves or hang on chosen files)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def training_pids(run_dir: Path, env_entry: str) -> list[int]:
    """This run's training processes (not their shells) whose environment holds `env_entry`, e.g. HOROVOD_RANK=0."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            "python" in Path(cmdline[0].decode(errors="replace")).name
            and str(run_dir).encode() in cmdline
            and env_entry.encode() in environ
        ):
            pids.append(int(proc.name))
    return pids


def epochs_logged(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / "train_log.json").read_text())["epochs"])
    except (OSError, ValueError, KeyError):
        return 0


def run_killing_one_worker(
    command: list[str],
    env: dict,
    run_dir: Path,
    victim_env_entry: str,
    after_epochs: int = 2,
    check_victim: Callable[[int], None] = lambda pid: None,
) -> tuple[int, str]:
    """Run `command`, kill the worker named by `victim_env_entry` once `after_epochs` are logged; (exit code, output)."""
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while epochs_logged(run_dir) < after_epochs and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = training_pids(run_dir, victim_env_entry)
        assert job.poll() is None and len(victims) == 1, (victims, job.poll())
        check_victim(victims[0])
        os.kill(victims[0], signal.SIGKILL)
        output, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return job.returncode, output


def decode_or_die(job: tuple) -> tuple:
    """A decode worker that SIGKILLs itself (as the out-of-memory killer would) on files named `die-always*`,
    and on `die-once*` the first time only (a marker file beside it remembers); otherwise the real decode."""
    from covidxray.data.image_cache import decode_one

    path = Path(job[0])
    marker = path.with_name(path.name + ".died")
    if path.name.startswith("die-always") or (path.name.startswith("die-once") and not marker.exists()):
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return decode_one(job)


SLOW_DECODE_S = 1.5  # how long decode_or_hang takes on files named `slow*`


def decode_or_hang(job: tuple) -> tuple:
    """A decode that never ends (as a decoder looping on a crafted file would) on files named `hang-always*`,
    and on `hang-once*` the first time only (a marker file beside it remembers); `slow*` files take
    SLOW_DECODE_S; otherwise the real decode."""
    from covidxray.data.image_cache import decode_one

    path = Path(job[0])
    marker = path.with_name(path.name + ".hung")
    if path.name.startswith("hang-always") or (path.name.startswith("hang-once") and not marker.exists()):
        marker.touch()
        time.sleep(3600)
    if path.name.startswith("slow"):
        time.sleep(SLOW_DECODE_S)
    return decode_one(job)


def _result_pipe():
    """In a decode worker: the write end of the pipe its results go back on (the executor's result queue)."""
    import sys

    frame = sys._getframe()
    while frame.f_code.co_name != "_process_worker":
        frame = frame.f_back
    return frame.f_locals["result_queue"]._writer


def decode_or_break_off(job: tuple) -> tuple:
    """On files named `half-*`: send the first bytes of a result message (a length header and a little of its
    body), as a worker killed while sending would leave them, then SIGKILL itself (`half-die*`) or hang
    (`half-hang*`); otherwise the real decode."""
    import struct

    from covidxray.data.image_cache import decode_one

    name = Path(job[0]).name
    if name.startswith("half-"):
        os.write(_result_pipe().fileno(), struct.pack("!i", 1 << 20) + b"\x80" * 100)
        if name.startswith("half-die"):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    return decode_one(job)
