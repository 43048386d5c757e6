"""Stopping `prepare` (issue 25: 3.1, N21): Ctrl-C, SIGTERM or kill -9 of its main process during decoding ends it
within seconds and leaves no decode worker or resource tracker behind.

Each run is a real `covidxray prepare` in its own session, so every process it starts, however deep, is found
by its session id after the main process is gone (orphans are re-parented and cannot be found by parent id).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from conftest import SHARED_DATA, covidxray_cmd, with_default_sigint
from kill_worker import decode_or_break_off
from layouts import write_image

from covidxray.data import decode_pool, image_cache

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
    """A covid19-talo folder: the real 512 px NIH films when ../shared/data has them (a real film's result message
    is ~29 kB, sent in two writes, as in the report), else 240 phantoms at 512 px; several seconds of decoding."""
    real = SHARED_DATA / "covid19-talo-nih-half-512"
    if real.is_dir():
        return real
    data = tmp_path_factory.mktemp("films") / "COVID-19-master" / "X-Ray Image DataSet"
    for n in range(240):
        folder = ("No_findings", "Pneumonia", "Covid-19")[n % 3]
        write_image(data / folder / f"{10000 + n:08d}_000.png", seed=n, size=512)
    return data.parent


@pytest.fixture
def half_sent(tmp_path) -> list[str]:
    """Ordinary images and one whose worker breaks off in the middle of sending its result (kill_worker.py)."""
    names = ["half-die.png", "half-hang.png"] + [f"ok-{i}.png" for i in range(8)]
    return [str(write_image(tmp_path / "images" / name, seed=n)) for n, name in enumerate(names)]


def decode_bounded(paths: list[str], cache_file: Path, progress=lambda n: None) -> tuple[dict, list[str]]:
    """decode_all with two workers in a thread, which must end within EXIT_BOUND_S: (results or the exception, log)."""
    import threading

    outcome: dict = {}
    lines: list[str] = []

    def run():
        try:
            with image_cache.ImageCache(cache_file) as cache:
                outcome["results"], _ = cache.decode_all(
                    paths, 32, 2, progress, log=lines.append, decode=decode_or_break_off
                )
        except BaseException as err:  # noqa: BLE001 (the interrupt under test)
            outcome["raised"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(EXIT_BOUND_S * 3)
    assert not worker.is_alive(), "decoding hung"
    return outcome, lines


def test_a_worker_that_dies_halfway_through_sending_a_result_does_not_hang_decoding(half_sent, tmp_path):
    """The executor's reader waits for the rest of a half-sent message for good, unless the pool is stopped whole."""
    outcome, lines = decode_bounded([p for p in half_sent if "hang" not in p], tmp_path / "cache.sqlite")
    results = outcome["results"]
    assert results[half_sent[0]].reason == decode_pool.WORKER_DIED
    assert all(results[p].ok for p in half_sent[2:])
    assert any("a decode worker died" in line for line in lines)


def test_ctrl_c_while_a_result_is_half_sent_ends_decoding_at_once(half_sent, tmp_path):
    """Ctrl-C with the executor's reader stuck in a half-sent message: the process ends, its workers with it."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from kill_worker import decode_or_break_off; "
        "from covidxray.data.image_cache import ImageCache\n"
        "with ImageCache(__import__('pathlib').Path(sys.argv[2])) as cache:\n"
        "    try:\n"
        "        cache.decode_all(sys.argv[3:], 32, 2, lambda n: None, decode=decode_or_break_off)\n"
        "    except KeyboardInterrupt:\n"
        "        sys.exit(130)\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "cache.sqlite"), *half_sent[1:]],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=with_default_sigint,
    )
    deadline = time.monotonic() + 120
    while len(session_processes(job.pid)) < 4 and time.monotonic() < deadline:  # itself, tracker, two workers
        time.sleep(0.1)
    time.sleep(3)  # the half message is out, every other result swallowed after it
    code, stderr = stop_and_check(job, signal.SIGINT)
    assert code == 130, stderr[-2000:]


def start_prepare(source: Path, data_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        covidxray_cmd(
            "prepare",
            "--source",
            f"covid19-talo={source}",
            "--data-dir",
            str(data_dir),
            "--task",
            "pneumonia",
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
        preexec_fn=with_default_sigint,
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
        raise AssertionError(f"{EXIT_BOUND_S} s after {signal.Signals(signum).name}, still running: {left}") from None
    deadline = time.monotonic() + ORPHAN_BOUND_S
    while (left := session_processes(job.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        os.killpg(job.pid, signal.SIGKILL)
    assert not left, f"left running {ORPHAN_BOUND_S} s after prepare ended: {left}"
    return job.returncode, stderr


def test_a_stopped_pool_leaves_no_manager_thread_ending_when_the_process_exits():
    """Python 3.11's concurrent.futures exit hook wakes each pool's manager thread through a pipe that thread closes
    as it ends, without a lock: a Ctrl-C whose process exits while the thread is still ending printed an
    `OSError: [Errno 9] Bad file descriptor` traceback after prepare's message. stop_pool waits for the thread."""
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(time.sleep, 60) for _ in range(4)]
    deadline = time.monotonic() + 60
    while not any(future.running() for future in futures) and time.monotonic() < deadline:
        time.sleep(0.01)
    manager = pool._executor_manager_thread
    assert manager is not None and manager.is_alive()
    decode_pool.stop_pool(pool)
    assert not manager.is_alive()
    assert all(future.done() for future in futures)  # each ended with BrokenProcessPool, none left waiting


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
    rerun = start_prepare(many_films, data_dir)
    _, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stderr[-2000:]  # what the killed run left is reused, not in the way
