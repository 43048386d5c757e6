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
from test_tensorboard import assert_board_matches_log

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
    train = " ".join(
        _train_args(
            synthetic_data,
            f"{tmp_path}/rank$HOROVOD_RANK",
            2,
            "--set",
            "train.warmup_epochs=1",
            "--set",
            "train.learning_rate=0.001",
            "--set",
            "train.lr_schedule=constant",
        )
    )
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
    assert_board_matches_log(tmp_path / "rank0", images_for={1, 2})  # both ranks' images/s, written by rank 0 once


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
        env = {
            **ENV,
            "PATH": f"{REPO / 'scripts' / 'mpich-shim'}{os.pathsep}{ENV['PATH']}",
            "COVIDXRAY_REAL_MPIRUN": shutil.which("mpirun"),
        }
    result = subprocess.run(
        [*command, COVIDXRAY, *_train_args(synthetic_data, run_dir, 2)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
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
        HOROVODRUN,
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--host-discovery-script",
        str(REPO / "scripts" / "discover_hosts.sh"),
        COVIDXRAY,
        *_train_args(
            synthetic_data, run_dir, epochs, "--elastic", "--batch-size", "8", "--set", "train.lr_schedule=constant"
        ),
    ]
    returncode, output = run_killing_one_worker(
        command, {**ENV, "COVIDXRAY_HOSTS_FILE": str(hosts_file)}, run_dir, "HOROVOD_RANK=0"
    )
    assert returncode == 0, output[-4000:]
    log = _log(run_dir)
    assert [e["epoch"] for e in log["epochs"]] == list(range(1, epochs + 1))
    sizes = [e["world_size"] for e in log["epochs"]]
    assert sizes[0] == 2 and sizes[-1] == 1, sizes
    assert log["epochs"][-1]["lr"] == pytest.approx(1e-3)  # LR rescaled to the one surviving rank
    assert log["elastic"] is True and len(log["weights_sha256_per_rank"]) == 1
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["epoch"] == epochs
    # the new rank 0 continued the old one's TensorBoard curves: every epoch once, the log's values
    assert_board_matches_log(run_dir, images_for=None, rank_local=True)


def test_discovery_script_prints_host_slots(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the cluster\npi01:2\npi02   # spare PSU\n\n  pi03:1\nbad:x\npi04 slots=3\n")
    result = subprocess.run(
        [str(REPO / "scripts" / "discover_hosts.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "COVIDXRAY_HOSTS_FILE": str(hosts), "COVIDXRAY_DEFAULT_SLOTS": "4"},
    )
    assert result.returncode == 0
    assert result.stdout.split() == ["pi01:2", "pi02:4", "pi03:1", "pi04:3"]  # horovodrun's hostfile lines work too
    assert "bad:x" in result.stderr
    missing = subprocess.run(
        [str(REPO / "scripts" / "discover_hosts.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "COVIDXRAY_HOSTS_FILE": str(tmp_path / "nope")},
    )
    assert missing.returncode != 0 and "COVIDXRAY_HOSTS_FILE" in missing.stderr


def test_doctor_json_reports_horovod_build_and_verifies_shards(synthetic_data):
    result = run_cli("doctor", "--json", "--data-dir", str(synthetic_data), "--no-memory-probe")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    import horovod.tensorflow as hvd

    assert report["ok"] is True
    assert report["horovod"]["controllers"] == {"gloo": hvd.gloo_built(), "mpi": hvd.mpi_built()}
    assert report["versions"]["horovod"] == "0.28.1" and report["versions"]["tensorflow"].startswith("2.15")
    assert report["system"]["cores_usable"] >= 1 and report["system"]["disk_free_mb"] > 0
    assert report["shards"]["shards"] == len(json.loads((synthetic_data / "manifest.json").read_text())["shards"])
    assert {c["name"] for c in report["checks"] if c["required"]} >= {
        "tensorflow",
        "horovod",
        "shards match manifest sha256",
    }


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
    assert diagnose(copy, memory_probe=False)["ok"] is False  # so `covidxray doctor` exits non-zero


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_gradient_compression_and_fusion_settings_reach_horovod(compression):
    """The averaged gradient is rounded exactly as float16 arithmetic rounds it, and only with fp16 compression."""
    import numpy as np

    probe = [str(VENV_BIN / "python"), str(REPO / "tests" / "compression_probe.py"), compression, "16", "2.5"]
    result = subprocess.run(
        [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", *probe],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads(
        next(line.split(">:", 1)[1] for line in result.stdout.splitlines() if line.startswith("[0]<stdout>:{"))
    )
    gradients = np.array([1.0001, 1.0003], np.float32)  # tests/compression_probe.py X
    if compression == "fp16":
        halves = gradients.astype(np.float16)
        expected = float((halves[0] + halves[1]) / np.float16(2))
    else:
        expected = float(gradients.mean())
    assert report["size"] == 2
    assert report["weight"] == pytest.approx(-expected, rel=1e-6, abs=1e-7)
    if compression == "fp16":
        assert report["weight"] != pytest.approx(-float(gradients.mean()), abs=1e-5)  # float32 would not round it away
    assert report["environment"] == {"HOROVOD_FUSION_THRESHOLD": str(16 * 2**20), "HOROVOD_CYCLE_TIME": "2.5"}


@pytest.mark.slow
def test_doctor_measures_a_pi_sized_training_rank_on_real_xrays(shared_data, tmp_path):
    """`doctor --data-dir` with configs/pi-cluster.yaml trains its model (efficientnet_lite0, ImageNet weights, early
    stages frozen) at 224 px, batch 16, on real images."""
    from covidxray.config import load_config
    from covidxray.data.prepare import prepare

    data_dir = tmp_path / "talo"
    talo = {"covid19-talo": {"from_path": str(shared_data / "covid19-talo-sample")}}
    prepare(
        load_config(
            None, [{"data": {"sources": talo, "data_dir": str(data_dir), "image_size": 224, "records_per_shard": 8}}]
        ).data,
        log=lambda _m: None,
    )
    result = run_cli(
        "doctor", "--json", "--data-dir", str(data_dir), "--config", str(REPO / "configs" / "pi-cluster.yaml")
    )
    report = json.loads(result.stdout)
    memory = report["training_memory"]
    assert "error" not in memory, memory
    assert (memory["model"], memory["image_size"], memory["batch_size"]) == ("efficientnet_lite0", 224, 16)
    assert memory["horovod"] == {"gradient_compression": "none", "fusion_buffer_mb": 16, "cycle_time_ms": 1.0}
    # a TensorFlow process holding a model is hundreds of MB; VmHWM is in kB, so a unit slip would show here
    assert 200 < memory["peak_rss_mb"] < 8192
    check = next(c for c in report["checks"] if c["name"] == "fits this board")
    assert check["ok"] == memory["fits"] == (memory["peak_rss_mb"] + memory["headroom_mb"] <= memory["available_mb"])
    assert check["detail"].startswith("yes: " if memory["fits"] else "no")
    assert result.returncode == (0 if report["ok"] else 1)


def test_doctor_warns_when_the_hostname_resolves_to_loopback(monkeypatch):
    """Raspberry Pi OS's /etc/hosts maps the hostname to 127.0.1.1, where Gloo's allreduce connections would listen."""
    import socket

    from covidxray.doctor import gloo_address

    def resolving_to(address):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return lambda *args, **kwargs: [(family, socket.SOCK_STREAM, 6, "", (address, 0))]

    monkeypatch.setattr(socket, "gethostname", lambda: "pi07")
    monkeypatch.setattr(socket, "getaddrinfo", resolving_to("127.0.1.1"))
    loopback = gloo_address()
    assert loopback["reachable"] is False and "127.0.1.1" in loopback["detail"] and "/etc/hosts" in loopback["detail"]
    monkeypatch.setattr(socket, "getaddrinfo", resolving_to("::1"))
    assert gloo_address()["reachable"] is False
    monkeypatch.setattr(socket, "getaddrinfo", resolving_to("192.168.1.107"))
    assert gloo_address() == {
        "hostname": "pi07",
        "address": "192.168.1.107",
        "reachable": True,
        "detail": "pi07 -> 192.168.1.107",
    }


def test_tuning_leaves_horovod_defaults_unset_and_refuses_the_elastic_crash(monkeypatch):
    """A default is unset (Horovod 0.28.1 then does not fix it; with both fixed an elastic job's survivors segfault)."""
    from covidxray.errors import UserError
    from covidxray.train.distributed import HorovodTuning

    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "999")  # as horovodrun --fusion-threshold-mb would: the config wins
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "7")
    HorovodTuning(fusion_buffer_mb=16, cycle_time_ms=1.0).apply(elastic=True)
    assert os.environ["HOROVOD_FUSION_THRESHOLD"] == str(16 * 2**20) and "HOROVOD_CYCLE_TIME" not in os.environ
    with pytest.raises(UserError, match="cannot change both train.fusion_buffer_mb and train.cycle_time_ms"):
        HorovodTuning(fusion_buffer_mb=16, cycle_time_ms=2.5).apply(elastic=True)
    HorovodTuning(fusion_buffer_mb=16, cycle_time_ms=2.5).apply(elastic=False)
    assert os.environ["HOROVOD_CYCLE_TIME"] == "2.5"
