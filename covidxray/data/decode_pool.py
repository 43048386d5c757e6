"""Run a decode function over many files in worker processes that may die, hang or be interrupted (prepare's decode).

Decode workers are separate processes; one killed from outside (the
out-of-memory killer on a 4 GB board) breaks the pool. The files it may have
been decoding are then retried one at a time, each alone in a fresh worker, so
a file that kills its worker twice is named and dropped instead of hanging or
ending the run. A decode running longer than data.decode_timeout_s (a crafted
file can send a decoder into an endless loop) has its worker killed the same
way: the file is named, retried once alone, then dropped as decode-timeout,
and the files the stopped pool held are queued again.

Workers never outlive prepare: on Linux the kernel kills each one when
prepare's process ends, however it ends (kill -9 included), and an
interrupt or error in prepare stops the pool without waiting for a decode
in progress. A pool is always stopped whole (every worker killed and the
result pipe closed on our side), because a worker killed while it sends a
result leaves half a message that would keep the executor's reader, and so
prepare's exit, waiting for good.

With one worker, files are decoded in the calling process, where nothing can
stop a stuck decoder: a file over the limit is named in the log.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

_IN_FLIGHT_PER_WORKER = 2  # enough to keep every worker busy; also bounds the files suspected when one dies
WORKER_DIED = "worker-died"  # the reason of a file that killed its decode worker twice
DECODE_TIMEOUT = "decode-timeout"  # the reason of a file dropped for decoding longer than data.decode_timeout_s twice
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal this process gets when its parent ends
_LIVENESS_CHECK_S = 1.0  # how often the pool's workers are checked for one that died
# A stopped pool's manager thread ends within milliseconds; the bound only keeps an unforeseen hang out of Ctrl-C
_MANAGER_EXIT_S = 10.0
Job = tuple[str, int, int]  # (path, image size, max pixels)
Log = Callable[[str], None]
Outcome = Any  # what the decode function returns for a job, passed on to `take` as it is
# (job, WORKER_DIED or DECODE_TIMEOUT, why in words) -> the outcome `take` gets for a file the pool gave up on
Failed = Callable[[Job, str, str], Outcome]


def keep_freed_buffers() -> bool:
    """Let this process reuse freed image buffers instead of handing them back to the kernel.

    A decoded radiograph (1 MB at 1024 px, tens of MB for a large 16-bit DICOM)
    is above glibc's default mmap threshold, so every decode maps, page-faults
    and unmaps fresh memory; reusing it decodes ~15% faster (scripts/bench_prepare.py).
    Memory already freed is kept up to 64 MB. False where libc has no mallopt (not glibc).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # libc is already loaded: no library search (a subprocess)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 64 << 20))


def _why(reason: str, timeout_s: float) -> str:
    """Why a file was given up on, and what to do if it is a valid radiograph."""
    if reason == WORKER_DIED:
        return (
            "the decode worker was killed twice while decoding this file (e.g. by the out-of-memory killer); "
            "skipped. Lower data.max_pixels or data.workers if it is a valid radiograph"
        )
    return (
        f"decoding took longer than data.decode_timeout_s ({timeout_s:g} s) twice, the second time alone in a "
        "fresh worker (a decoder stuck on a crafted file?); skipped. Raise data.decode_timeout_s if it is a "
        "valid radiograph on a slow board"
    )


_start_reports: (
    SimpleQueue  # set in each decode worker by _start_worker: where it reports each job it starts (see _PoolRun)
)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this worker when prepare's process ends (Linux; a no-op where libc has no prctl)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it ended before the death signal was set
        os._exit(1)


def _start_worker(start_reports, parent_pid: int) -> None:
    global _start_reports
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is prepare's to handle: it stops the whole pool
    _start_reports = start_reports
    keep_freed_buffers()


def _decode_reporting_start(decode: Callable, index: int, job: Job) -> Outcome:
    # A few bytes, written at once (SimpleQueue has no feeder thread), so the report is out before a decoder
    # that holds the GIL can hang, and a worker killed later never leaves half a message in the pipe.
    _start_reports.put((index, os.getpid(), time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process
    return decode(job)


@dataclass
class _PoolEnd:
    """How one pool's run ended: every job done, or the jobs that still need an answer."""

    timed_out: list[Job] = field(default_factory=list)  # their decode passed the limit; their worker was killed
    in_doubt: list[Job] = field(default_factory=list)  # in flight when a worker died by itself
    requeue: list[Job] = field(default_factory=list)  # not started, or innocent bystanders of a stopped pool


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop `pool` at once, without waiting for any decode: kill every worker, and close our end of the result pipe
    so that the executor's manager thread, even one reading half a message from a killed worker, sees its end;
    then let that thread finish (milliseconds, with nothing left to wait for).

    (ProcessPoolExecutor only gained kill_workers() in Python 3.14; this is it, plus the pipe.) The wait is for
    Python 3.11's exit: concurrent.futures' exit hook wakes every pool's manager thread through a pipe the thread
    closes as it ends, unlocked (cpython gh-125451, locked from 3.12), so a Ctrl-C whose process exits while this
    thread is still ending could print an `OSError: [Errno 9] Bad file descriptor` traceback after prepare's
    message (seen in one of two full test runs: tests/test_interrupt.py).
    """
    processes = list((pool._processes or {}).values())
    results = pool._result_queue
    manager: threading.Thread | None = pool._executor_manager_thread  # type: ignore[assignment]  # shutdown() forgets it
    pool.shutdown(wait=False)  # no cancel_futures: every future then ends with BrokenProcessPool, none Cancelled
    for process in processes:
        process.kill()
    if results is not None:
        results._writer.close()  # type: ignore[attr-defined]  # the executor's private pipe end; no public way to close it
    if manager is not None:
        manager.join(_MANAGER_EXIT_S)


class _PoolRun:
    """Feed jobs to a pool of spawned workers, passing each result to `take`, with an optional per-file time limit.

    The limit counts from when a worker starts the file, which the worker reports, not from submission:
    each worker holds _IN_FLIGHT_PER_WORKER jobs so it never waits for the next one, and a file queued
    behind a slow one must not be blamed for it. (Keeping only `workers` jobs in flight would make
    submission time nearly start time, but it would idle every worker between files and still count
    a worker's start-up, seconds on a loaded board, against its first file.)
    A ProcessPoolExecutor cannot cancel a running call, so a file over the limit stops the pool (a worker that
    dies by itself does too); the files its other workers held are queued again.
    """

    def __init__(self, workers: int, decode: Callable, take: Callable, timeout_s: float):
        self.workers, self.decode, self.take, self.timeout_s = workers, decode, take, timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.in_flight: dict = {}  # future -> (index, job)
        self.started: dict[int, tuple[int, float]] = {}  # index -> (worker pid, monotonic start)
        self.stopped: set[int] = set()  # indices whose decode passed the limit (their pool was stopped for them)
        self.stopping = False

    def run(self, jobs: list[Job]) -> _PoolEnd:
        pending = deque(enumerate(jobs))
        start_reports = self.context.SimpleQueue()
        pool = ProcessPoolExecutor(
            self.workers, mp_context=self.context, initializer=_start_worker, initargs=(start_reports, os.getpid())
        )
        try:
            end = self._feed(pool, pending, start_reports)
        except BrokenProcessPool:
            end = self._after_break([job for _, job in pending])
        except BaseException:  # Ctrl-C, a full disk in `take`: never wait for a decode, nor for a stuck pool
            stop_pool(pool)
            raise
        finally:
            start_reports.close()
        pool.shutdown(wait=True)  # its workers are idle or gone: this returns at once
        return end

    def _feed(self, pool: ProcessPoolExecutor, pending: deque, start_reports) -> _PoolEnd:
        while True:
            while not self.stopping and pending and len(self.in_flight) < self.workers * _IN_FLIGHT_PER_WORKER:
                index, job = pending[0]
                self.in_flight[pool.submit(_decode_reporting_start, self.decode, index, job)] = (index, job)
                pending.popleft()
            if not self.in_flight:
                return _PoolEnd(requeue=[job for _, job in pending])
            done, _ = wait(self.in_flight, timeout=self._until_next_check(), return_when=FIRST_COMPLETED)
            for future in done:
                self.take(future.result())  # raises BrokenProcessPool once the pool was stopped
                del self.in_flight[future]
            self._read_start_reports(start_reports)  # also without a limit: unread, they would fill the pipe
            if not self.stopping and (self._overdue() or self._a_worker_died(pool)):
                self.stopping = True
                stop_pool(pool)

    def _read_start_reports(self, start_reports) -> None:
        while not start_reports.empty():
            index, pid, started = start_reports.get()
            self.started[index] = (pid, started)

    def _until_next_check(self) -> float:
        """Seconds to wait for a result before looking for a dead worker or a file over the limit."""
        if not self.timeout_s:
            return _LIVENESS_CHECK_S
        now = time.monotonic()
        running = [
            self.started[i][1] for i, _ in self.in_flight.values() if i in self.started and i not in self.stopped
        ]
        return min(
            _LIVENESS_CHECK_S, max(0.0, min([*running, now]) + self.timeout_s - now)
        )  # a file starting now is due last

    def _overdue(self) -> bool:
        """Mark the files whose decode passed the limit; whether there are any."""
        if not self.timeout_s:
            return False
        now = time.monotonic()
        overdue = [
            index
            for future, (index, _) in self.in_flight.items()
            if not future.done()
            and index in self.started
            and index not in self.stopped
            and now - self.started[index][1] > self.timeout_s
        ]
        self.stopped.update(overdue)
        return bool(overdue)

    @staticmethod
    def _a_worker_died(pool: ProcessPoolExecutor) -> bool:
        """A worker ended while jobs are in flight (killed by the system, most often)."""
        sentinels = [process.sentinel for process in list((pool._processes or {}).values())]
        return bool(sentinels and multiprocessing.connection.wait(sentinels, timeout=0))

    def _after_break(self, not_started: list[Job]) -> _PoolEnd:
        """Keep every result that arrived; sort the other jobs in flight by what they need next."""
        end = _PoolEnd(requeue=not_started)
        unanswered = []
        for future, (index, job) in self.in_flight.items():
            if future.done() and future.exception() is None:
                self.take(future.result())
            elif index in self.stopped:
                end.timed_out.append(job)
            else:
                unanswered.append(job)
        if self.stopped:  # the pool was stopped on purpose: the others did nothing wrong
            end.requeue[:0] = unanswered
        else:
            end.in_doubt = unanswered
        return end


def _given_up_alone(job: Job, decode: Callable, take: Callable, timeout_s: float) -> str:
    """One file in a fresh single-worker pool: its result goes to `take` and "" is returned, or, when it fails there
    too, why it has none (WORKER_DIED or DECODE_TIMEOUT)."""
    end = _PoolRun(1, decode, take, timeout_s).run([job])
    if end.timed_out:
        return DECODE_TIMEOUT
    if end.in_doubt:
        return WORKER_DIED
    return ""


class _SlowFileWarning:
    """Decode in this process (workers: 1), where nothing can stop a decoder stuck in C: name the file, at least.

    One watching thread for the whole run (a timer per file cost more than a small file's decode on a busy board).
    """

    def __init__(self, timeout_s: float, log: Log):
        self.timeout_s, self.log = timeout_s, log
        self.changed = threading.Condition()
        self.current: tuple[str, float] | None = None  # (path, monotonic start) of the file being decoded
        self.finished = False
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _SlowFileWarning:
        if self.timeout_s:
            self.watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.finished = True
            self.changed.notify()
        if self.watcher.is_alive():
            self.watcher.join()

    def decode(self, job: Job, decode: Callable) -> Outcome:
        if not self.timeout_s:
            return decode(job)
        with self.changed:
            self.current = (job[0], time.monotonic())
            self.changed.notify()
        try:
            return decode(job)
        finally:
            with self.changed:
                self.current = None

    def _watch(self) -> None:
        warned = None
        with self.changed:
            while not self.finished:
                current = self.current
                if current is None or current is warned:
                    self.changed.wait()
                    continue
                remaining = current[1] + self.timeout_s - time.monotonic()
                if remaining > 0:
                    self.changed.wait(remaining)
                    continue
                warned = current
                self.log(
                    f"{current[0]}: still decoding after data.decode_timeout_s ({self.timeout_s:g} s); with data.workers 1 "
                    "it cannot be stopped (interrupt, move the file aside, or set data.workers to 2 or more to have it skipped)"
                )


def decode_each(
    jobs: list[Job],
    decode: Callable[[Job], Outcome],
    take: Callable[[Outcome], None],
    *,
    workers: int,
    timeout_s: float,
    log: Log,
    failed: Failed,
) -> None:
    """`take(decode(job))` for every job, in `workers` processes, each file within `timeout_s` seconds (0: no
    limit); a file the pool gives up on gets `take(failed(job, reason, why))` instead.

    A file over the time limit, or the files a worker that died may have held, are retried one by one, each alone
    in a fresh worker; then the rest go on in a new pool. One worker (or a single job without a limit) decodes
    here, in this process: no pool to start.
    """
    if workers <= 1 or (len(jobs) <= 1 and not timeout_s):
        keep_freed_buffers()
        with _SlowFileWarning(timeout_s, log) as here:
            for job in jobs:
                take(here.decode(job, decode))
        return
    remaining = jobs
    while remaining:
        end = _PoolRun(min(workers, len(remaining)), decode, take, timeout_s).run(remaining)
        for job in end.timed_out:
            log(
                f"{job[0]}: still decoding after data.decode_timeout_s ({timeout_s:g} s); "
                "stopped its worker, retrying it alone in a fresh one"
            )
        if end.in_doubt:
            log(
                f"a decode worker died (killed by the system?) while decoding one of: {', '.join(job[0] for job in end.in_doubt)}; "
                "retrying each of them alone in a fresh worker"
            )
        for job in end.timed_out + end.in_doubt:
            gave_up = _given_up_alone(job, decode, take, timeout_s)
            if gave_up:
                why = _why(gave_up, timeout_s)
                log(f"skipped {job[0]}: {why}")
                take(failed(job, gave_up, why))
        remaining = end.requeue
