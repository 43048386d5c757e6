"""`covidxray doctor`: what this board has, in a form a cluster script can compare across boards.

A 35-board job fails on its weakest board: an old wheel, a Horovod built
without Gloo, a missing mpirun, a full SD card or a shard that differs from
the manifest (or a manifest edited after prepare sealed it). `--json` output from every board (over ssh) can be diffed;
the exit status is non-zero when something training needs is missing.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from covidxray.errors import UserError

MIN_FREE_MEMORY_MB = 1024
MIN_FREE_DISK_MB = 2048
# Left for the OS, sshd, the page cache of the shards and the allocator's swings between steps.
MEMORY_HEADROOM_MB = 256
MEMORY_PROBE_STEPS = 5
MEMORY_PROBE_TIMEOUT_S = 900
# Report name -> distributions providing it (TensorFlow is `tensorflow-cpu` on x86-64, `tensorflow` on a Pi).
VERSIONED_PACKAGES = {
    "covidxray": ("covidxray",),
    "tensorflow": ("tensorflow", "tensorflow-cpu"),
    "keras": ("keras",),
    "numpy": ("numpy",),
    "horovod": ("horovod",),
    "ai-edge-litert": ("ai-edge-litert",),
    "albumentations": ("albumentations",),
    "opencv": ("opencv-python-headless", "opencv-python"),
}


def _version(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _package_versions() -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        **{name: _version(dists) for name, dists in VERSIONED_PACKAGES.items()},
    }


def _available_memory_mb() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def check_shards(data_dir: Path) -> dict:
    """The manifest is intact (its own checksum), every shard it lists exists with the sha256 it recorded,
    and the tables beside it (splits.csv, ...) are the ones it records."""
    from covidxray.files import sha256_file
    from covidxray.manifest import open_prepared, shard_problems

    try:
        data = open_prepared(data_dir)
    except UserError as err:
        return {
            "data_dir": str(data_dir),
            "manifest_error": str(err),
            "shards": 0,
            "missing": [],
            "sha256_mismatch": [],
            "tables_mismatch": [],
        }
    tables = data.manifest.table_sha256
    return {
        "data_dir": str(data_dir),
        "manifest_error": None,
        "shards": len(data.manifest.shards),
        **shard_problems(data),
        "tables_mismatch": [
            name
            for name, sha in sorted(tables.items())
            if not (data_dir / name).is_file() or sha256_file(data_dir / name) != sha
        ],
    }


def training_memory(data_dir: Path, config_path: Path | None, available_mb: int | None) -> dict:
    """Does one training rank of this config fit this board? Measured: covidxray.train.memory_probe in a child process.

    Fits when the rank's peak RSS plus MEMORY_HEADROOM_MB is within the memory
    available before the probe started (one rank per board, as in
    configs/pi-cluster.yaml).
    """
    command = [
        sys.executable,
        "-m",
        "covidxray.train.memory_probe",
        "--data-dir",
        str(data_dir),
        "--steps",
        str(MEMORY_PROBE_STEPS),
    ]
    if config_path:
        command += ["--config", str(config_path)]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=MEMORY_PROBE_TIMEOUT_S,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
    except subprocess.TimeoutExpired:
        return {"fits": False, "error": f"the memory probe did not finish within {MEMORY_PROBE_TIMEOUT_S} s"}
    if result.returncode != 0:
        return {"fits": False, "error": (result.stderr.strip().splitlines() or ["memory probe failed"])[-1]}
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    fits = available_mb is not None and measured["peak_rss_mb"] + MEMORY_HEADROOM_MB <= available_mb
    return {**measured, "available_mb": available_mb, "headroom_mb": MEMORY_HEADROOM_MB, "fits": fits}


def _memory_detail(memory: dict) -> str:
    if "error" in memory:
        return f"no: {memory['error']}"
    setup = f"{memory['model']}, {memory['image_size']} px, batch {memory['batch_size']}"
    if memory["horovod"]:
        setup += f", fusion buffer {memory['horovod']['fusion_buffer_mb']} MiB, {memory['horovod']['gradient_compression']} gradients"
    verdict = "yes" if memory["fits"] else "no (lower train.batch_size, train.fusion_buffer_mb or the image size)"
    return f"{verdict}: a training rank ({setup}) peaked at {memory['peak_rss_mb']:.0f} MB; {memory['available_mb']} MB available, {memory['headroom_mb']} MB kept free"


def gloo_address() -> dict:
    """The address Horovod's Gloo allreduce connections listen on, and whether other boards can reach it.

    Horovod 0.28.1 creates the Gloo contexts that carry every collective (its
    process-set contexts) without the --network-interface it was given: Gloo
    then resolves this machine's hostname and binds the first address it gets.
    Raspberry Pi OS maps the hostname to 127.0.1.1 in /etc/hosts, so a
    multi-board job fails with "connect [127.0.1.1]: Connection refused".
    """
    hostname = socket.gethostname()
    try:
        address = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as err:
        return {
            "hostname": hostname,
            "address": None,
            "reachable": False,
            "detail": f"{hostname} does not resolve ({err}): add it to /etc/hosts with this board's LAN address",
        }
    if ipaddress.ip_address(address).is_loopback:
        return {
            "hostname": hostname,
            "address": address,
            "reachable": False,
            "detail": f"{hostname} resolves to {address}: other boards cannot reach Gloo there; in /etc/hosts map {hostname} to this board's LAN address",
        }
    return {"hostname": hostname, "address": address, "reachable": True, "detail": f"{hostname} -> {address}"}


def _check(name: str, ok: bool, detail: str, required: bool = True) -> dict:
    return {"name": name, "ok": bool(ok), "required": required, "detail": detail}


def _refuse_bad_arguments(data_dir: Path | None, config_path: Path | None) -> None:
    """A missing folder or a broken config is the user's error here, not a failed check."""
    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder")
    if config_path is not None:
        from covidxray.config import load_config

        load_config(config_path)


def _built(ok: bool, fix: str) -> str:
    return "built" if ok else f"missing: {fix}"


def _horovod_checks(horovod: dict) -> list[dict]:
    """Horovod itself, then (when installed) what it was built with and whether its launchers work here."""
    checks = [_check("horovod", horovod["installed"], horovod.get("version") or horovod.get("error", ""))]
    if not horovod["installed"]:
        return checks
    with_tf, controllers = horovod["frameworks"]["tensorflow"], horovod["controllers"]
    checks += [
        _check(
            "horovod built for TensorFlow",
            with_tf,
            _built(with_tf, "reinstall horovod against the installed TF (scripts/install.sh)"),
        ),
        _check(
            "gloo controller (horovodrun --gloo, elastic)",
            controllers["gloo"],
            _built(controllers["gloo"], "rebuild with HOROVOD_WITH_GLOO=1"),
        ),
        _check(
            "mpi controller (mpirun)",
            controllers["mpi"],
            _built(controllers["mpi"], "install MPICH and rebuild with HOROVOD_WITH_MPI=1"),
            required=False,
        ),
        _check(
            "mpirun",
            bool(horovod["mpirun"]) or not controllers["mpi"],
            horovod["mpirun"] or "not on PATH (apt install mpich)",
            required=False,
        ),
    ]
    if horovod["mpirun"]:
        checks.append(_mpi_detected_check(horovod["horovodrun_mpi_detects"]))
    return checks


def _mpi_detected_check(detected: str) -> dict:
    recognised = detected not in ("Unknown", "Missing")
    return _check(
        "horovodrun --mpi recognises this MPI",
        recognised,
        detected
        if recognised
        else "no (MPICH 4 prints HYDRA): put scripts/mpich-shim first on PATH, or launch with mpirun -np N -f machinefile",
        required=False,
    )


def _room_checks(memory_mb: int | None, free_disk_mb: int, disk_at: Path) -> list[dict]:
    return [
        _check(
            "free memory",
            memory_mb is None or memory_mb >= MIN_FREE_MEMORY_MB,
            f"{memory_mb} MB available" if memory_mb is not None else "unknown",
            required=False,
        ),
        _check("free disk", free_disk_mb >= MIN_FREE_DISK_MB, f"{free_disk_mb} MB free at {disk_at}", required=False),
    ]


def _shard_checks(shards: dict) -> list[dict]:
    """The manifest's own checksum, the shards' and (when they differ) the tables' against the manifest."""
    damaged = shards["missing"] + shards["sha256_mismatch"]
    checks = [
        _check(
            "manifest intact (its own checksum)",
            not shards["manifest_error"],
            shards["manifest_error"] or "checksum matches",
        ),
        _check(
            "shards match manifest sha256",
            not damaged,
            f"{shards['shards']} shards verified"
            if not damaged
            else f"missing {shards['missing']}, changed {shards['sha256_mismatch']}: re-copy them or re-run prepare",
        ),
    ]
    if shards["tables_mismatch"]:
        checks.append(
            _check(
                "tables match manifest",
                False,
                f"{', '.join(shards['tables_mismatch'])} not the one(s) manifest.json records: re-run prepare",
                required=False,
            )
        )
    return checks


def _is_damaged(shards: dict) -> bool:
    return bool(shards["missing"] or shards["sha256_mismatch"] or shards["manifest_error"])


def _fits_check(memory: dict | None) -> dict:
    """Whether one training rank fits; `memory` None: not measured, because the data set is damaged."""
    if memory is None:  # a probe on damaged shards would fail for that reason, not for lack of memory
        return _check(
            "fits this board",
            False,
            "not measured: the data set is damaged (see the checks above); repair it with prepare first",
            required=False,
        )
    return _check("fits this board", memory["fits"], _memory_detail(memory))


def diagnose(data_dir: Path | None = None, config_path: Path | None = None, memory_probe: bool = True) -> dict:
    from covidxray.train.distributed import cores_per_rank, horovod_build

    _refuse_bad_arguments(data_dir, config_path)
    versions, horovod, gloo = _package_versions(), horovod_build(), gloo_address()
    memory_mb = _available_memory_mb()
    disk_at = Path(data_dir) if data_dir else Path.cwd()
    free_disk_mb = shutil.disk_usage(disk_at).free // (1 << 20)

    checks = [
        _check("tensorflow", bool(versions["tensorflow"]), versions["tensorflow"] or "not installed"),
        *_horovod_checks(horovod),
        *_room_checks(memory_mb, free_disk_mb, disk_at),
        _check("gloo address reachable from other boards", gloo["reachable"], gloo["detail"], required=False),
    ]
    shards = memory = None
    if data_dir is not None:
        shards = check_shards(Path(data_dir))
        checks += _shard_checks(shards)
        if memory_probe:
            memory = None if _is_damaged(shards) else training_memory(Path(data_dir), config_path, memory_mb)
            checks.append(_fits_check(memory))
    return {
        "ok": all(c["ok"] for c in checks if c["required"]),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "versions": versions,
        "horovod": horovod,
        "system": {
            "cores_usable": cores_per_rank(1),
            "cores_total": os.cpu_count(),
            "memory_available_mb": memory_mb,
            "disk_free_mb": free_disk_mb,
            "disk_checked_at": str(disk_at),
        },
        "shards": shards,
        "training_memory": memory,
        "gloo": gloo,
        "checks": checks,
    }


def render(report: dict, console) -> None:
    from rich.table import Table

    console.print(
        f"[bold]{report['host']}[/] ({report['machine']}): "
        + ", ".join(f"{k} {v or '-'}" for k, v in report["versions"].items())
    )
    system = report["system"]
    console.print(
        f"cores {system['cores_usable']}/{system['cores_total']} usable, {system['memory_available_mb']} MB memory available, {system['disk_free_mb']} MB free at {system['disk_checked_at']}"
    )
    table = Table("check", "", "detail")
    for check in report["checks"]:
        mark = "[green]ok[/]" if check["ok"] else ("[red]MISSING[/]" if check["required"] else "[yellow]warn[/]")
        table.add_row(check["name"], mark, check["detail"])
    console.print(table)
    console.print("[green]ready to train[/]" if report["ok"] else "[red]not ready: fix the MISSING items above[/]")
