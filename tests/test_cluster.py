"""Issue 7: the cluster side, run for real over ssh to loopback "boards" 127.0.0.2 and 127.0.0.3.

A throwaway sshd (tests/sshd.py) serves both addresses; horovodrun does not
count them as local, so every rank, rsync and doctor call goes through ssh,
which the sshd log proves. All traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, VENV_BIN, have_horovod
from kill_worker import run_killing_one_worker
from sshd import HOSTS, SSH, SSHD, start_sshd

CLUSTER = REPO / "scripts" / "cluster"
sys.path.insert(0, str(CLUSTER))
COVIDXRAY = str(VENV_BIN / "covidxray")
HOROVODRUN = str(VENV_BIN / "horovodrun")
PYTHON = str(VENV_BIN / "python")

pytestmark = pytest.mark.skipif(not have_horovod(), reason="horovod is not installed in this venv")
needs_sshd = pytest.mark.skipif(
    not (SSHD and SSH and shutil.which("rsync")),
    reason="needs openssh-server, openssh-client and rsync (scripts/install.sh installs them)",
)


def script(name: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    command = ["bash", str(CLUSTER / name)] if name.endswith(".sh") else [PYTHON, str(CLUSTER / name)]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if not (SSHD and SSH and shutil.which("rsync")):
        pytest.skip("needs openssh-server, openssh-client and rsync (scripts/install.sh installs them)")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hostfile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "hostfile"
    result = script("make_hostfile.py", *HOSTS, "-o", str(path))
    assert result.returncode == 0, result.stderr
    return path


@pytest.fixture(scope="module")
def synced(sshd, hostfile, synthetic_data, tmp_path_factory) -> dict:
    """rsync the data to a fresh board-side path: first one board alone, then all of them."""
    remote = tmp_path_factory.mktemp("board") / "data"
    common = [
        "--hostfile",
        str(hostfile),
        "--data-dir",
        str(synthetic_data),
        "--remote-data-dir",
        str(remote),
        *sshd.ssh_args(),
    ]
    only = script("sync_shards.py", *common, "--only", HOSTS[1], env=sshd.env())
    assert only.returncode == 0, only.stdout + only.stderr
    only_files = sorted(p.name for p in (remote / "shards").iterdir())
    everyone = script("sync_shards.py", *common, env=sshd.env())
    assert everyone.returncode == 0, everyone.stdout + everyone.stderr
    return {"dir": remote, "only_files": only_files, "only_output": only.stdout, "all_output": everyone.stdout}


def _manifest_files(data_dir: Path, split: str) -> set[str]:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    return {s["file"] for s in manifest["shards"] if s["split"] == split and s["records"]}


def test_make_hostfile_writes_what_horovod_reads(tmp_path):
    from nodes import place_ranks, read_hostfile

    boards = tmp_path / "boards.txt"
    boards.write_text("# rack A\npi01.local\npi02.local:2   # the 8 GB one\n\npi03 slots=3\n")
    out = tmp_path / "hostfile"
    result = script("make_hostfile.py", "--from", str(boards), "pi04", "--slots", "1", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_text() == "pi01.local slots=1\npi02.local slots=2\npi03 slots=3\npi04 slots=1\n"
    assert "-np 7" in result.stderr
    placed = [(s.hostname, s.rank) for s in place_ranks(read_hostfile(out))]  # Horovod's own parser and placement
    assert placed == [
        ("pi01.local", 0),
        ("pi02.local", 1),
        ("pi02.local", 2),
        ("pi03", 3),
        ("pi03", 4),
        ("pi03", 5),
        ("pi04", 6),
    ]

    duplicate = script("make_hostfile.py", "pi01", "pi01")
    assert duplicate.returncode == 2 and "listed twice" in duplicate.stderr and "Traceback" not in duplicate.stderr
    malformed = script("make_hostfile.py", "pi01 slots=many")
    assert malformed.returncode == 2 and "pi01 slots=many" in malformed.stderr
    from nodes import ClusterError

    with pytest.raises(ClusterError, match="make_hostfile"):
        read_hostfile(boards)  # the friendly list is not a hostfile: Horovod's reader would choke on it


def test_version_mismatch_and_failed_checks_are_named():
    from check_nodes import NodeResult, failed_checks, shard_problems, version_mismatches

    from covidxray.doctor import diagnose

    report = diagnose()
    older = json.loads(json.dumps(report))
    older["versions"]["tensorflow"] = "2.15.0"
    older["checks"].append({"name": "gloo controller", "ok": False, "required": True, "detail": "missing"})
    older["shards"] = {
        "missing": ["train-00001-of-00002.tfrecord", "test-00000-of-00001.tfrecord"],
        "sha256_mismatch": [],
    }
    results = [NodeResult("pi01", report), NodeResult("pi02", report), NodeResult("pi03", older)]
    assert version_mismatches(results) == [
        f"tensorflow differs: {report['versions']['tensorflow']} on pi01, pi02; 2.15.0 on pi03"
    ]
    assert version_mismatches(results[:2]) == []
    assert failed_checks(older) == ["gloo controller: missing"] and failed_checks(report) == []
    # only shards this board's ranks read count; a test shard it never reads may be absent
    needed = ["manifest.json", "shards/train-00001-of-00002.tfrecord", "shards/val-00000-of-00001.tfrecord"]
    assert shard_problems(older, needed) == ["missing shard train-00001-of-00002.tfrecord"]


@needs_sshd
def test_distribute_keys_installs_once_and_the_key_alone_logs_in(sshd, hostfile, tmp_path):
    key = tmp_path / "launcher" / "id_ed25519"
    login_with_new_key = ["ssh", "-p", str(sshd.port), "-o", "IdentitiesOnly=yes", "-i", str(key), HOSTS[0], "true"]
    keys = [
        "-i",
        str(key),
        "-p",
        str(sshd.port),
        "-b",
        str(sshd.identity),
        str(hostfile),
    ]  # -b: stands in for the board's password

    first = script("distribute_keys.sh", *keys, env=sshd.env())
    assert first.returncode == 0, first.stdout + first.stderr
    assert key.is_file() and f"{HOSTS[0]}: key installed" in first.stdout
    assert subprocess.run(login_with_new_key, env=sshd.env(), capture_output=True).returncode == 0
    again = script("distribute_keys.sh", *keys, env=sshd.env())
    assert again.returncode == 0 and again.stdout.count("key already accepted") == len(HOSTS)
    assert sshd.authorized_keys.read_text().count(key.with_suffix(".pub").read_text().split()[1]) == 1

    no_way_in = script(
        "distribute_keys.sh", "-i", str(tmp_path / "other"), "-p", str(sshd.port), str(hostfile), env=sshd.env()
    )
    assert no_way_in.returncode == 1 and f"{len(HOSTS)} board(s) without the key" in no_way_in.stderr


@needs_sshd
def test_sync_shards_copies_each_board_only_its_ranks_shards(synced, synthetic_data, sshd, hostfile):
    only = synced["only_files"]
    train = _manifest_files(synthetic_data, "train")
    only_train = {f for f in only if f.startswith("train-")}
    assert only_train and only_train < train  # a strict subset: the other board's shards were not copied
    only_val = {f for f in only if f.startswith("val-")}
    assert only_val and only_val <= _manifest_files(synthetic_data, "val")  # val is split over ranks too
    rows = {line.split()[0]: line for line in synced["all_output"].splitlines()}
    assert "0 file(s) copied" in rows[HOSTS[1]]  # the second sync found that board complete
    assert (
        f"{len(train - only_train) + len(_manifest_files(synthetic_data, 'val') - only_val)} file(s) copied"
        in rows[HOSTS[0]]
    )  # just the first board's own
    assert set(os.listdir(synced["dir"] / "shards")) == train | _manifest_files(
        synthetic_data, "val"
    )  # two boards x their halves, no test shards
    assert sshd.logins()[HOSTS[0]] >= 1 and sshd.logins()[HOSTS[1]] >= 2

    nfs_ok = script(
        "sync_shards.py",
        "--hostfile",
        str(hostfile),
        "--data-dir",
        str(synthetic_data),
        "--nfs",
        str(synced["dir"]),
        *sshd.ssh_args(),
        env=sshd.env(),
    )
    assert nfs_ok.returncode == 0 and nfs_ok.stdout.count(" ok") == len(HOSTS), nfs_ok.stdout + nfs_ok.stderr
    nfs_missing = script(
        "sync_shards.py",
        "--hostfile",
        str(hostfile),
        "--data-dir",
        str(synthetic_data),
        "--nfs",
        "/nonexistent/mount",
        *sshd.ssh_args(),
        env=sshd.env(),
    )
    assert nfs_missing.returncode == 1 and nfs_missing.stdout.count("MISSING") == len(HOSTS)


@needs_sshd
def test_check_nodes_runs_doctor_on_every_board_and_names_a_missing_shard(synced, sshd, hostfile, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(synced["dir"], data)
    args = ["--hostfile", str(hostfile), "--data-dir", str(data), *sshd.ssh_args()]
    before = sshd.logins()
    ready = script("check_nodes.py", *args, env=sshd.env())
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert f"all {len(HOSTS)} board(s) ready" in ready.stdout
    assert all(sshd.logins()[h] > before[h] for h in HOSTS)  # doctor ran over ssh on each

    only_second_board = sorted(f for f in synced["only_files"] if f.startswith("train-"))[0]
    (data / "shards" / only_second_board).unlink()
    broken = script("check_nodes.py", *args, env=sshd.env())
    assert broken.returncode == 1
    rows = {line.split()[0]: line for line in broken.stdout.splitlines() if line.startswith(HOSTS)}
    assert rows[HOSTS[0]].endswith("ok") and rows[HOSTS[1]].endswith("FAIL")  # the first board never reads that shard
    assert f"missing shard {only_second_board}" in broken.stdout

    unreachable = tmp_path / "hostfile"
    unreachable.write_text(f"{HOSTS[0]} slots=1\n127.0.0.4 slots=1\n")  # nothing listens there
    down = script("check_nodes.py", "--hostfile", str(unreachable), *sshd.ssh_args(), env=sshd.env())
    assert down.returncode == 1 and "127.0.0.4" in down.stdout and "no doctor report" in down.stdout


@pytest.mark.slow
@needs_sshd
def test_static_training_over_ssh_reads_the_synced_shards(synced, sshd, hostfile, tmp_path):
    run_dir = tmp_path / "run"
    before = sshd.logins()
    command = [
        HOROVODRUN,
        "--gloo",
        "-np",
        "2",
        "--hostfile",
        str(hostfile),
        *sshd.ssh_args(),
        "--network-interface",
        "lo",
        "--disable-cache",
        "--start-timeout",
        "120",
        COVIDXRAY,
        "train",
        "--data-dir",
        str(synced["dir"]),
        "--run-dir",
        str(run_dir),
        "--epochs",
        "2",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**sshd.env(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert all(sshd.logins()[h] > before[h] for h in HOSTS), sshd.logins()  # both ranks were started through ssh

    log = json.loads((run_dir / "train_log.json").read_text())
    assert log["world_size"] == 2 and len(set(log["weights_sha256_per_rank"])) == 1
    assert [r["host"] for r in log["ranks"]] == list(HOSTS)  # named as in the hostfile, so a slow board can be found
    # rank 1 is the second board: it read exactly the shards sync_shards gave that board alone
    assert log["ranks"][1]["shards"] == [f for f in synced["only_files"] if f.startswith("train-")]
    assert not set(log["ranks"][0]["shards"]) & set(log["ranks"][1]["shards"])
    assert [len(e["images_per_s_per_rank"]) for e in log["epochs"]] == [2, 2]  # a slow board shows up per epoch
    assert all(rate > 0 for e in log["epochs"] for rate in e["images_per_s_per_rank"])
    assert output.count("slowest rank") == 2


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        pid = int(fields[1])
        chain.append(pid)
    return chain


@pytest.mark.slow
@needs_sshd
def test_elastic_training_over_ssh_finishes_when_a_board_dies(synced, sshd, hostfile, tmp_path):
    """The second board's worker is SIGKILLed after epoch 2; the job re-forms on the first board and finishes."""
    run_dir, epochs = tmp_path / "run", 5
    command = [
        HOROVODRUN,
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--host-discovery-script",
        str(REPO / "scripts" / "discover_hosts.sh"),  # reads the same hostfile
        *sshd.ssh_args(),
        "--network-interface",
        "lo",
        "--disable-cache",
        "--start-timeout",
        "120",
        COVIDXRAY,
        "train",
        "--elastic",
        "--data-dir",
        str(synced["dir"]),
        "--run-dir",
        str(run_dir),
        "--epochs",
        str(epochs),
        "--batch-size",
        "8",
    ]
    env = {**sshd.env(), "TF_CPP_MIN_LOG_LEVEL": "2", "COVIDXRAY_HOSTS_FILE": str(hostfile)}

    def runs_inside_ssh(pid: int) -> None:
        assert sshd.process.pid in _ancestors(pid)  # that worker runs inside an ssh session

    returncode, output = run_killing_one_worker(
        command, env, run_dir, f"HOROVOD_HOSTNAME={HOSTS[1]}", check_victim=runs_inside_ssh
    )
    assert returncode == 0, output[-4000:]
    log = json.loads((run_dir / "train_log.json").read_text())
    assert [e["epoch"] for e in log["epochs"]] == list(range(1, epochs + 1))
    assert log["epochs"][0]["world_size"] == 2 and log["epochs"][-1]["world_size"] == 1
    assert [len(e["images_per_s_per_rank"]) for e in log["epochs"]] == [e["world_size"] for e in log["epochs"]]


# --- issue 18: the emulated cluster (scripts/netcluster.sh): a network namespace per board, shaped links ---

NETCLUSTER = REPO / "scripts" / "netcluster.sh"
NET_NAME, NET_SUBNET = (
    "cxrt",
    "10.214.0",
)  # not the defaults, so a cluster built by hand or by the benchmark is left alone
NET_STATE = Path(f"/run/covidxray-netcluster-{NET_NAME}")


def _can_build_namespaces() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True)
    return probe.returncode == 0


needs_netns = pytest.mark.skipif(
    not (SSHD and _can_build_namespaces()), reason="needs root, iproute2 (ip netns, tc) and openssh-server"
)


def netcluster(action: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(NETCLUSTER), action, "--name", NET_NAME, "--subnet", NET_SUBNET, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _leftovers() -> list[str]:
    namespaces = [
        n
        for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if n.startswith(f"{NET_NAME}-")
    ]
    links = [
        line
        for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
        if f": {NET_NAME}" in line
    ]
    files = [str(p) for p in (NET_STATE, *Path("/etc/netns").glob(f"{NET_NAME}-*")) if p.exists()]
    return namespaces + links + files


@pytest.fixture
def emulated_boards():
    """Two emulated boards on 100 Mbit/s ports (slow enough that the shaper, not this machine's CPU, is the limit)."""
    built = netcluster("up", "-n", "2", "--line-mbit", "100")
    try:
        assert built.returncode == 0, built.stdout + built.stderr
        yield dict(line.split("=", 1) for line in (NET_STATE / "env").read_text().split())
    finally:
        netcluster("down")


@needs_netns
def test_emulated_boards_are_shaped_reachable_over_ssh_and_removed(emulated_boards):
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_allreduce import link_check

    ssh = ["ip", "netns", "exec", f"{NET_NAME}-launch", str(NET_STATE / "bin" / "ssh")]
    for _board, address in ((1, f"{NET_SUBNET}.11"), (2, f"{NET_SUBNET}.12")):
        seen = subprocess.run(
            [
                *ssh,
                address,
                "ip -o -4 addr show dev eth0; python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert seen.returncode == 0, seen.stderr
        assert f"inet {address}/24" in seen.stdout  # the session runs inside that board's namespace
        assert seen.stdout.split()[-1] == address  # where Horovod 0.28.1's Gloo will listen (its hostname)
    link = link_check(NET_NAME, NET_SUBNET, 2.0)
    payload_floor = 100 * 1448 / 1538  # Mbit/s of TCP payload in 1500-byte frames on a 100 Mbit/s wire
    assert 0.9 * payload_floor < link["tcp_payload_mbit_per_s"] <= 1.02 * payload_floor
    assert link["tcp_rtt_s"] < 1e-3  # sub-millisecond, like boards on one switch
    assert (NET_STATE / "hostfile").read_text() == f"{NET_SUBNET}.11 slots=1\n{NET_SUBNET}.12 slots=1\n"

    again = netcluster("up", "-n", "2", "--line-mbit", "100")  # idempotent: rebuilt from scratch, not doubled
    assert again.returncode == 0, again.stderr
    assert netcluster("down").returncode == 0
    assert _leftovers() == []
    assert netcluster("status").returncode == 1


@needs_netns
def test_emulated_cluster_is_removed_when_its_command_is_interrupted():
    import signal
    import time

    run = subprocess.Popen(
        ["bash", str(NETCLUSTER), "run", "--name", NET_NAME, "--subnet", NET_SUBNET, "-n", "1", "--", "sleep", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (NET_STATE / "env").exists() and time.monotonic() < deadline:
            time.sleep(0.002)  # the signal lands within ms of the state file: the moment `up` hands over to `run`
        assert (NET_STATE / "env").exists(), "the cluster never came up"
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
        leftovers = _leftovers()
        netcluster("down")
    assert leftovers == []


@pytest.mark.slow
@needs_netns
def test_horovodrun_reduces_over_the_shaped_links(emulated_boards, tmp_path):
    """Every byte of a 2-rank ring goes out through each board's shaped port: tc's counters see at least that much."""

    def sent_bytes(board: int) -> int:
        stats = subprocess.run(
            ["ip", "netns", "exec", f"{NET_NAME}-b{board}", "tc", "-s", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        return int(stats.split("Sent ")[1].split()[0])

    before = [sent_bytes(1), sent_bytes(2)]
    out, size_mib, calls = tmp_path / "probe.json", 4, 3  # 1 warm-up + 2 timed
    command = [
        HOROVODRUN,
        "--gloo",
        "-np",
        "2",
        "--hostfile",
        f"{emulated_boards['STATE']}/hostfile",
        "--ssh-identity-file",
        f"{emulated_boards['STATE']}/id_ed25519",
        "--network-interface",
        "eth0",
        "--disable-cache",
        "--start-timeout",
        "300",
        PYTHON,
        str(REPO / "scripts" / "_allreduce_probe.py"),
        "--sizes-mib",
        str(size_mib),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    result = netcluster("exec", "--", *command, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["ranks"] == 2 and report["sizes"][0]["bytes"] == size_mib * 2**20
    ring_bytes_per_rank = 2 * (2 - 1) / 2 * size_mib * 2**20 * calls
    assert all(sent_bytes(b) - before[b - 1] >= ring_bytes_per_rank for b in (1, 2))
    floor = 2 * (2 - 1) / 2 * size_mib * 2**20 / (100e6 / 8 * 1448 / 1538)
    assert all(
        seconds >= 0.95 * floor for seconds in report["sizes"][0]["seconds"]
    )  # the shaper holds it to the wire's rate
