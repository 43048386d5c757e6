"""`covidxray doctor`: what this board has, in a form a cluster script can compare across boards.

A 35-board job fails on its weakest board: an old wheel, a Horovod built
without Gloo, a missing mpirun, a full SD card or a shard that differs from
the manifest (or a manifest edited after prepare sealed it). `--json` output from every board (over ssh) can be diffed;
the exit status is non-zero when something training needs is missing.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
from pathlib import Path

from covidxray.errors import UserError

MIN_FREE_MEMORY_MB = 1024
MIN_FREE_DISK_MB = 2048
# Report name -> distributions providing it (TensorFlow is `tensorflow-cpu` on x86-64, `tensorflow` on a Pi).
VERSIONED_PACKAGES = {
    "covidxray": ("covidxray",), "tensorflow": ("tensorflow", "tensorflow-cpu"), "keras": ("keras",), "numpy": ("numpy",),
    "horovod": ("horovod",), "ai-edge-litert": ("ai-edge-litert",), "albumentations": ("albumentations",),
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
    return {"python": platform.python_version(), **{name: _version(dists) for name, dists in VERSIONED_PACKAGES.items()}}


def _available_memory_mb() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def check_shards(data_dir: Path) -> dict:
    """The manifest is intact (its own checksum) and every shard it lists exists with the sha256 it recorded."""
    from covidxray.data.manifest import load_manifest, shard_problems

    try:
        manifest = load_manifest(data_dir)
    except UserError as err:
        return {"data_dir": str(data_dir), "manifest_error": str(err), "shards": 0, "missing": [], "sha256_mismatch": []}
    return {"data_dir": str(data_dir), "manifest_error": None, "shards": len(manifest["shards"]), **shard_problems(data_dir, manifest)}


def _check(name: str, ok: bool, detail: str, required: bool = True) -> dict:
    return {"name": name, "ok": bool(ok), "required": required, "detail": detail}


def diagnose(data_dir: Path | None = None) -> dict:
    from covidxray.train.distributed import cores_per_rank, horovod_build

    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder")
    versions = _package_versions()
    horovod = horovod_build()
    cores = cores_per_rank(1)
    memory_mb = _available_memory_mb()
    disk_at = Path(data_dir) if data_dir else Path.cwd()
    free_disk_mb = shutil.disk_usage(disk_at).free // (1 << 20)

    checks = [
        _check("tensorflow", bool(versions["tensorflow"]), versions["tensorflow"] or "not installed"),
        _check("horovod", horovod["installed"], horovod.get("version") or horovod.get("error", "")),
    ]
    if horovod["installed"]:
        controllers = horovod["controllers"]
        checks += [
            _check("horovod built for TensorFlow", horovod["frameworks"]["tensorflow"],
                   "built" if horovod["frameworks"]["tensorflow"] else "missing: reinstall horovod against the installed TF (scripts/install.sh)"),
            _check("gloo controller (horovodrun --gloo, elastic)", controllers["gloo"], "built" if controllers["gloo"] else "missing: rebuild with HOROVOD_WITH_GLOO=1"),
            _check("mpi controller (mpirun)", controllers["mpi"], "built" if controllers["mpi"] else "missing: install MPICH and rebuild with HOROVOD_WITH_MPI=1", required=False),
            _check("mpirun", bool(horovod["mpirun"]) or not controllers["mpi"], horovod["mpirun"] or "not on PATH (apt install mpich)", required=False),
        ]
        if horovod["mpirun"]:
            detected = horovod["horovodrun_mpi_detects"]
            checks.append(_check(
                "horovodrun --mpi recognises this MPI", detected not in ("Unknown", "Missing"),
                detected if detected not in ("Unknown", "Missing")
                else "no (MPICH 4 prints HYDRA): put scripts/mpich-shim first on PATH, or launch with mpirun -np N -f machinefile",
                required=False,
            ))
    checks += [
        _check("free memory", memory_mb is None or memory_mb >= MIN_FREE_MEMORY_MB, f"{memory_mb} MB available" if memory_mb is not None else "unknown", required=False),
        _check("free disk", free_disk_mb >= MIN_FREE_DISK_MB, f"{free_disk_mb} MB free at {disk_at}", required=False),
    ]
    shards = None
    if data_dir is not None:
        shards = check_shards(Path(data_dir))
        bad = shards["missing"] + shards["sha256_mismatch"]
        checks.append(_check("manifest intact (its own checksum)", not shards["manifest_error"], shards["manifest_error"] or "checksum matches"))
        checks.append(_check("shards match manifest sha256", not bad,
                             f"{shards['shards']} shards verified" if not bad else f"missing {shards['missing']}, changed {shards['sha256_mismatch']}: re-copy them or re-run prepare"))
    return {
        "ok": all(c["ok"] for c in checks if c["required"]),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "versions": versions,
        "horovod": horovod,
        "system": {"cores_usable": cores, "cores_total": os.cpu_count(), "memory_available_mb": memory_mb, "disk_free_mb": free_disk_mb, "disk_checked_at": str(disk_at)},
        "shards": shards,
        "checks": checks,
    }


def render(report: dict, console) -> None:
    from rich.table import Table

    console.print(f"[bold]{report['host']}[/] ({report['machine']}): " + ", ".join(f"{k} {v or '-'}" for k, v in report["versions"].items()))
    system = report["system"]
    console.print(f"cores {system['cores_usable']}/{system['cores_total']} usable, {system['memory_available_mb']} MB memory available, {system['disk_free_mb']} MB free at {system['disk_checked_at']}")
    table = Table("check", "", "detail")
    for check in report["checks"]:
        mark = "[green]ok[/]" if check["ok"] else ("[red]MISSING[/]" if check["required"] else "[yellow]warn[/]")
        table.add_row(check["name"], mark, check["detail"])
    console.print(table)
    console.print("[green]ready to train[/]" if report["ok"] else "[red]not ready: fix the MISSING items above[/]")
