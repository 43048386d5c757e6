"""Stopping `prepare` (issue 25: 3.1, N21): Ctrl-C, SIGTERM or kill -9 of its main process during decoding ends it
within seconds and leaves no decode worker or resource tracker behind.

Each run is a real `covidxray prepare` in its own session, so every process it starts, however deep, is found
by its session id after the main process is gone (orphans are re-parented and cannot be found by parent id).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import covidxray_cmd
from layouts import write_image

EXIT_BOUND_S = 20  # the main process must be gone this long after the signal (it used to hang for good)
ORPHAN_BOUND_S = 10  # and every process it started this long after that


def session_processes(session: int) -> list[str]:
    """'pid command' of every live process in `session` (zombies are dead: not counted)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, sid = fields[0], int(fields[3])
        if sid == session and state != "Z":
            found.append(f"{proc.name} {command[:120]}")
    return found


@pytest.fixture(scope="module")
def many_films(tmp_path_factory) -> Path:
    """A covid19-talo folder of 240 images at 512 px: several seconds of decoding for two workers."""
    data = tmp_path_factory.mktemp("films") / "COVID-19-master" / "X-Ray Image DataSet"
    for n in range(240):
        folder = ("No_findings", "Pneumonia", "Covid-19")[n % 3]
        write_image(data / folder / f"{10000 + n:08d}_000.png", seed=n, size=512)
    return data.parent


def start_prepare(source: Path, data_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        covidxray_cmd(
            "prepare",
            "--source",
            f"covid19-talo={source}",
            "--data-dir",
            str(data_dir),
            "--image-size",
            "64",
            "--workers",
            "2",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def wait_for_decoding(job: subprocess.Popen, data_dir: Path) -> None:
    """Until the decode cache exists (decoding starts right after) and two workers run."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if list((data_dir / "cache").glob("*.sqlite")) and len(session_processes(job.pid)) >= 3:
            return
        time.sleep(0.05)
    raise AssertionError(f"prepare did not start decoding (exit {job.poll()})")


def stop_and_check(job: subprocess.Popen, signum: int) -> tuple[int, str]:
    """Send `signum` to the main process only; (its exit code, its stderr) once it and all its processes are gone."""
    os.kill(job.pid, signum)
    try:
        _, stderr = job.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        left = session_processes(job.pid)
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        alive = "still runs" if job.poll() is None else "ended, but its processes keep its output open"
        raise AssertionError(f"{EXIT_BOUND_S} s after {signal.Signals(signum).name}, prepare {alive}: {left}")
    deadline = time.monotonic() + ORPHAN_BOUND_S
    while (left := session_processes(job.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        os.killpg(job.pid, signal.SIGKILL)
    assert not left, f"left running {ORPHAN_BOUND_S} s after prepare ended: {left}"
    return job.returncode, stderr


@pytest.mark.slow
def test_ctrl_c_at_random_moments_of_decoding_never_hangs_and_leaves_no_process(many_films, tmp_path):
    chance = random.Random(25)
    for attempt in range(12):
        data_dir = tmp_path / f"data-{attempt}"
        job = start_prepare(many_films, data_dir)
        wait_for_decoding(job, data_dir)
        time.sleep(chance.uniform(0, 2.5))
        code, stderr = stop_and_check(job, signal.SIGINT)
        if code == 0:  # decoding and shards finished before the signal: nothing to interrupt
            continue
        assert code == 130 and "Traceback" not in stderr, (attempt, code, stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_killing_prepare_takes_its_decode_workers_and_resource_tracker_with_it(signum, many_films, tmp_path):
    data_dir = tmp_path / "data"
    job = start_prepare(many_films, data_dir)
    wait_for_decoding(job, data_dir)
    time.sleep(0.5)
    code, _ = stop_and_check(job, signum)
    assert code == -signum
    rerun = subprocess.run(
        [
            *covidxray_cmd("prepare"),
            "--source",
            f"covid19-talo={many_films}",
            "--data-dir",
            str(data_dir),
            "--image-size",
            "64",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-2000:]  # what the killed run left is reused, not in the way
