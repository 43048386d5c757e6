"""Issue 4: multi-process training under Gloo, MPI and elastic Horovod; `covidxray doctor`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, have_horovod, run_cli
from kill_worker import run_killing_one_worker

pytestmark = pytest.mark.skipif(not have_horovod(), reason="horovod is not installed in this venv")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
COVIDXRAY = str(VENV_BIN / "covidxray")
HOROVODRUN = str(VENV_BIN / "horovodrun")


def _train_args(data_dir: Path, run_dir: Path | str, epochs: int, *extra: str) -> list[str]:
    return ["train", "--data-dir", str(data_dir), "--run-dir", str(run_dir), "--epochs", str(epochs), *extra]


def _log(run_dir: Path) -> dict:
    return json.loads((run_dir / "train_log.json").read_text())


def _assert_replicas_agree(log: dict, ranks: int) -> None:
    digests = log["weights_sha256_per_rank"]
    assert len(digests) == ranks and len(set(digests)) == 1


@pytest.mark.slow
def test_gloo_two_ranks_agree_warm_up_and_only_rank_0_writes(synthetic_data, tmp_path):
    """Each rank gets its own --run-dir: rank 1's must never come into existence."""
    train = " ".join(_train_args(synthetic_data, f"{tmp_path}/rank$HOROVOD_RANK", 2, "--set", "train.warmup_epochs=1", "--set", "train.learning_rate=0.001", "--set", "train.lr_schedule=constant"))
    command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", "sh", "-c", f"exec {COVIDXRAY} {train}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0"]
    log = _log(tmp_path / "rank0")
    _assert_replicas_agree(log, 2)
    assert log["world_size"] == 2 and [e["epoch"] for e in log["epochs"]] == [1, 2]
    assert all(len(e["images_per_s_per_rank"]) == 2 for e in log["epochs"])
    shards = [set(r["shards"]) for r in log["ranks"]]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    manifest = json.loads((synthetic_data / "manifest.json").read_text())
    assert shards[0] | shards[1] == {s["file"] for s in manifest["shards"] if s["split"] == "train"}
    # LR scaled by the world size, reached at the end of the one warmup epoch
    assert [e["lr"] for e in log["epochs"]] == pytest.approx([0.002, 0.002])
    assert log["optimizer_steps"] == 2 * log["steps_per_epoch"]
    assert "[1]<stderr>:epoch" not in result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (apt install mpich)")
@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun --mpi"])
def test_mpi_two_ranks_agree(synthetic_data, tmp_path, launcher):
    """MPICH's own launcher, and horovodrun --mpi through scripts/mpich-shim (horovod 0.28.1 misses MPICH 4)."""
    run_dir = tmp_path / "run"
    env = ENV
    if launcher == "mpirun":
        command = ["mpirun", "-np", "2"]
    else:
        command = [HOROVODRUN, "--mpi", "-np", "2", "-H", "localhost:2"]
        env = {**ENV, "PATH": f"{REPO / 'scripts' / 'mpich-shim'}{os.pathsep}{ENV['PATH']}", "COVIDXRAY_REAL_MPIRUN": shutil.which("mpirun")}
    result = subprocess.run([*command, COVIDXRAY, *_train_args(synthetic_data, run_dir, 2)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    log = _log(run_dir)
    _assert_replicas_agree(log, 2)
    assert log["world_size"] == 2 and [e["epoch"] for e in log["epochs"]] == [1, 2]
    shards = [set(r["shards"]) for r in log["ranks"]]
    assert shards[0] and shards[1] and not shards[0] & shards[1]


@pytest.mark.slow
def test_elastic_job_survives_a_killed_worker(synthetic_data, tmp_path):
    """Two 'hosts' (localhost and 127.0.0.1 are both local to horovodrun, so no ssh); kill rank 0 mid-training.

    Rank 0 is the hard case: the survivor becomes rank 0 and must carry on the
    log, best model and checkpoints from the replicated state.
    """
    hosts_file, run_dir, epochs = tmp_path / "hosts.txt", tmp_path / "run", 6
    hosts_file.write_text("localhost:1\n127.0.0.1:1\n")
    command = [
        HOROVODRUN, "-np", "2", "--min-np", "1", "--max-np", "2",
        "--host-discovery-script", str(REPO / "scripts" / "discover_hosts.sh"),
        COVIDXRAY, *_train_args(synthetic_data, run_dir, epochs, "--elastic", "--batch-size", "8", "--set", "train.lr_schedule=constant"),
    ]
    returncode, output = run_killing_one_worker(command, {**ENV, "COVIDXRAY_HOSTS_FILE": str(hosts_file)}, run_dir, "HOROVOD_RANK=0")
    assert returncode == 0, output[-4000:]
    log = _log(run_dir)
    assert [e["epoch"] for e in log["epochs"]] == list(range(1, epochs + 1))
    sizes = [e["world_size"] for e in log["epochs"]]
    assert sizes[0] == 2 and sizes[-1] == 1, sizes
    assert log["epochs"][-1]["lr"] == pytest.approx(1e-3)  # LR rescaled to the one surviving rank
    assert log["elastic"] is True and len(log["weights_sha256_per_rank"]) == 1
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["epoch"] == epochs


def test_discovery_script_prints_host_slots(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the cluster\npi01:2\npi02   # spare PSU\n\n  pi03:1\nbad:x\npi04 slots=3\n")
    result = subprocess.run([str(REPO / "scripts" / "discover_hosts.sh")], capture_output=True, text=True,
                            env={**os.environ, "COVIDXRAY_HOSTS_FILE": str(hosts), "COVIDXRAY_DEFAULT_SLOTS": "4"})
    assert result.returncode == 0
    assert result.stdout.split() == ["pi01:2", "pi02:4", "pi03:1", "pi04:3"]  # horovodrun's hostfile lines work too
    assert "bad:x" in result.stderr
    missing = subprocess.run([str(REPO / "scripts" / "discover_hosts.sh")], capture_output=True, text=True,
                             env={**os.environ, "COVIDXRAY_HOSTS_FILE": str(tmp_path / "nope")})
    assert missing.returncode != 0 and "COVIDXRAY_HOSTS_FILE" in missing.stderr


def test_doctor_json_reports_horovod_build_and_verifies_shards(synthetic_data):
    result = run_cli("doctor", "--json", "--data-dir", str(synthetic_data))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    import horovod.tensorflow as hvd

    assert report["ok"] is True
    assert report["horovod"]["controllers"] == {"gloo": hvd.gloo_built(), "mpi": hvd.mpi_built()}
    assert report["versions"]["horovod"] == "0.28.1" and report["versions"]["tensorflow"].startswith("2.15")
    assert report["system"]["cores_usable"] >= 1 and report["system"]["disk_free_mb"] > 0
    assert report["shards"]["shards"] == len(json.loads((synthetic_data / "manifest.json").read_text())["shards"])
    assert {c["name"] for c in report["checks"] if c["required"]} >= {"tensorflow", "horovod", "shards match manifest sha256"}


def test_doctor_names_a_changed_or_missing_shard(synthetic_data, tmp_path):
    from covidxray.doctor import check_shards, diagnose

    copy = tmp_path / "data"
    shutil.copytree(synthetic_data / "shards", copy / "shards")
    shutil.copy(synthetic_data / "manifest.json", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    changed, removed = manifest["shards"][0]["file"], manifest["shards"][1]["file"]
    with open(copy / "shards" / changed, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    (copy / "shards" / removed).unlink()
    report = check_shards(copy)
    assert report["sha256_mismatch"] == [changed] and report["missing"] == [removed]
    assert diagnose(copy)["ok"] is False  # so `covidxray doctor` exits non-zero
