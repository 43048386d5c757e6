"""Issue 25, the data side: each case of the round-3 report (docs: shared/reviews/reliability-round3-2026-12-05.md)
rebuilt from its description, ending as the right result or one clear error.

Code from data (N6b), paths out of a collection (S2), credentials in a URL (S5b), one run per run folder (N7,
N8b, 7.4), a class without images (7.8), links and unreadable folders (N16b, N17a, N17d), a file where a folder
belongs (7.11, N22), a binary config (6.5), audit (N18c), doctor (N19b), archives (1.8, 4.3) and a full disk
right after the manifest switch (4.4).
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from conftest import covidxray_cmd, run_cli
from layouts import FileServer, build_ieee8023, build_kaggle, build_talo, prepare_config, write_image, zip_tree

from covidxray.config import ConfigError, load_config, parse_override
from covidxray.data.prepare import prepare
from covidxray.errors import UserError
from covidxray.files import sha256_file
from covidxray.manifest import SPLIT_TABLE, TABLE_SHA256, TABLES, open_prepared, seal
from covidxray.sources.archive import ExtractLimits, extract
from covidxray.sources.layout import BROKEN_LINK, OUTSIDE


def talo_config(data_dir: Path, talo: Path, **data):
    return prepare_config(data_dir, {"covid19-talo": {"from_path": str(talo)}}, **data)


@pytest.fixture
def talo(tmp_path) -> Path:
    return build_talo(tmp_path / "talo").root


def clear_error(result: subprocess.CompletedProcess) -> str:
    """The one-line error of a CLI run that must fail cleanly (exit 2, no traceback)."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, (result.returncode, result.stderr[-3000:])
    return " ".join(result.stderr.split())


# ------------------------------------------------------------------ N6b, 6.5: config input


def test_a_yaml_tag_is_refused_on_every_path_and_never_run(tmp_path):
    marker = tmp_path / "PWNED"
    tag = f'!!python/object/apply:os.system ["touch {marker}"]'
    with pytest.raises(ConfigError, match=r"--set train.epochs: not valid YAML: could not determine a constructor"):
        parse_override(f"train.epochs={tag}")
    config_file = tmp_path / "evil.yaml"
    config_file.write_text(f"train:\n  epochs: {tag}\n")
    with pytest.raises(ConfigError, match="evil.yaml: not valid YAML"):
        load_config(config_file)
    for command in (["train", "--set", f"train.epochs={tag}"], ["prepare", "--set", f"data.sources={tag}"]):
        assert "not valid YAML" in clear_error(run_cli(*command, "--data-dir", str(tmp_path / "d")))
    assert not marker.exists()


def test_a_binary_or_folder_config_file_is_named_not_a_traceback(tmp_path):
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(ConfigError, match=r"b.yaml is not a text \(UTF-8\) YAML file: byte 0 is 0xff"):
        load_config(binary)
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="dir.yaml is a folder"):
        load_config(folder)
    assert "is not a text (UTF-8) YAML file" in clear_error(run_cli("train", "-c", str(binary)))


# ------------------------------------------------------------------ S2: nothing outside the collection


def test_metadata_paths_that_leave_the_collection_are_dropped_with_their_row_and_never_read(tmp_path):
    layout = build_ieee8023(tmp_path / "ieee")
    outside = write_image(tmp_path / "elsewhere" / "secret.png", seed=9001)
    climb = os.path.relpath(outside.parent, layout.root / "images")
    with open(layout.root / "metadata.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    header = [name.strip().lower() for name in rows[0]]
    template = next(r for r in rows[1:] if layout.labels.get(r[header.index("filename")]) == "covid-19")

    def row(patient: str, folder: str, filename: str) -> list[str]:
        values = list(template)
        values[header.index("patientid")], values[header.index("filename")] = patient, filename
        values[header.index("folder")] = folder
        return values

    escapes = {
        "9002": row("9002", "images", str(outside)),  # an absolute file name
        "9003": row("9003", climb, outside.name),  # a folder full of '..'
        "9004": row("9004", "images", "../../../../../../../../etc/passwd"),
    }
    with open(layout.root / "metadata.csv", "a", newline="") as handle:
        csv.writer(handle).writerows(escapes.values())
    data_dir = tmp_path / "data"
    sources = {  # talo brings the normal images chest3 needs
        "covid-chestxray": {"from_path": str(layout.root)},
        "covid19-talo": {"from_path": str(build_talo(tmp_path / "talo").root)},
    }
    manifest = prepare(prepare_config(data_dir, sources), log=lambda _: None).to_json()
    kept = (data_dir / SPLIT_TABLE).read_text()
    assert str(outside) not in kept and "passwd" not in kept and "secret.png" not in kept
    with open(data_dir / "dropped.csv", newline="") as handle:
        outside_rows = [r for r in csv.DictReader(handle) if r["reason"] == OUTSIDE]
    assert sorted(r["detail"] for r in outside_rows) == sorted(
        f"folder {r[header.index('folder')]!r}, filename {r[header.index('filename')]!r}" for r in escapes.values()
    )  # each named with its metadata.csv line
    assert all(r["where"].startswith("metadata.csv:") for r in outside_rows)
    assert manifest["dropped"][f"covid-chestxray: {OUTSIDE}"] == 3
    assert "secret.png" not in (data_dir / "duplicates.csv").read_text()  # not even decoded to be compared


def test_every_adapter_is_held_to_the_collection_folder(talo, tmp_path, monkeypatch):
    """The check sits in prepare, after any adapter: one that built a path out of its folder is stopped there."""
    from covidxray.records import Record
    from covidxray.sources.covid19_talo import CovidTaloSource

    outside = write_image(tmp_path / "elsewhere" / "00004444_000.png", seed=4444)
    honest = CovidTaloSource.records

    def leaky(self, root):
        yield from honest(self, root)
        yield Record(image=outside, label="normal", patient_id="covid19-talo:x", source="covid19-talo")

    monkeypatch.setattr(CovidTaloSource, "records", leaky)
    manifest = prepare(talo_config(tmp_path / "data", talo), log=lambda _: None).to_json()
    assert manifest["dropped"][f"covid19-talo: {OUTSIDE}"] == 1
    assert "00004444" not in (tmp_path / "data" / SPLIT_TABLE).read_text()


# ------------------------------------------------------------------ N16b, N17a: links and unreadable folders


def test_broken_and_self_loop_links_are_listed_like_other_unusable_files(talo, tmp_path):
    folder = talo / "X-Ray Image DataSet" / "No_findings"
    os.symlink("00009000_000.png", folder / "00009000_000.png")  # points to itself
    os.symlink("/nonexistent/x.png", folder / "00009001_000.png")
    os.symlink("00001280_004.png", folder / "00009002_000.png")  # a good link: followed, then an exact copy
    data_dir = tmp_path / "data"
    manifest = prepare(talo_config(data_dir, talo), log=lambda _: None).to_json()
    with open(data_dir / "dropped.csv", newline="") as handle:
        broken = sorted(Path(r["where"]).name for r in csv.DictReader(handle) if r["reason"] == BROKEN_LINK)
    assert broken == ["00009000_000.png", "00009001_000.png"]
    assert manifest["dropped"][f"covid19-talo: {BROKEN_LINK}"] == 2


def without_root_powers() -> list[str]:
    """A command prefix that drops root's right to ignore file modes, or skip (chmod means nothing to plain root)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0:
        pytest.skip("root without setpriv: file modes cannot be tested")
    return prefix


@pytest.mark.parametrize("locked", ["source", "class folder"])
def test_an_unreadable_source_folder_is_named(talo, tmp_path, locked):
    prefix = without_root_powers()
    folder = talo if locked == "source" else talo / "X-Ray Image DataSet" / "No_findings"
    folder.chmod(0)
    try:
        result = subprocess.run(
            [*prefix, *covidxray_cmd("prepare")]
            + ["--source", f"covid19-talo={talo}", "--data-dir", str(tmp_path / "d"), "--image-size", "32"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        folder.chmod(0o755)
    message = clear_error(result)
    assert "permission denied" in message and "make it readable" in message


def test_output_folders_in_a_read_only_parent_are_refused_clearly(talo, synthetic_data, tmp_path):
    prefix = without_root_powers()
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    try:
        commands = [
            ["prepare", "--source", f"covid19-talo={talo}", "--data-dir", str(read_only / "d")],
            ["train", "--data-dir", str(synthetic_data), "--run-dir", str(read_only / "r"), "--epochs", "1"],
        ]
        for command in commands:
            result = subprocess.run([*prefix, *covidxray_cmd(*command)], capture_output=True, text=True, timeout=600)
            assert "no permission to create it" in clear_error(result)
    finally:
        read_only.chmod(0o755)


# ------------------------------------------------------------------ 7.11, N22: a file where a folder belongs


def test_a_file_given_as_data_dir_or_run_dir_is_named(talo, synthetic_data, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match=r"--data-dir .*afile is a file, not a folder"):
        prepare(talo_config(afile, talo), log=lambda _: None)
    with pytest.raises(UserError, match=r"--data-dir .*afile is a file, not a folder"):
        prepare(talo_config(afile / "sub", talo), log=lambda _: None)
    result = run_cli("train", "--data-dir", str(synthetic_data), "--run-dir", str(afile), "--epochs", "1")
    assert "afile is a file, not a folder" in clear_error(result)


# ------------------------------------------------------------------ 7.8: a class with no training images


def test_a_class_without_images_is_named_by_prepare_and_stops_train(tmp_path, synthetic_data):
    """Prepare warns (such a data set still serves as an external test set); train refuses it."""
    kaggle = build_kaggle(tmp_path / "kaggle").root
    said = []
    prepare(prepare_config(tmp_path / "d", {"chest-xray-pneumonia": {"from_path": str(kaggle)}}), log=said.append)
    assert any(re.search(r"warning: .*no 'covid-19' image for task chest3 .*--task pneumonia", line) for line in said)
    assert open_prepared(tmp_path / "d").manifest.splits["train"].classes["covid-19"] == 0
    result = run_cli("train", "--data-dir", str(tmp_path / "d"), "--run-dir", str(tmp_path / "r0"), "--epochs", "1")
    assert "train split has no 'covid-19' image for task chest3" in clear_error(result)

    data_dir = tmp_path / "no-covid"
    shutil.copytree(synthetic_data, data_dir)
    manifest = open_prepared(data_dir).manifest.to_json()
    manifest["splits"]["train"]["classes"]["covid-19"] = 0  # as a prepare of an older covidxray wrote it
    (data_dir / "manifest.json").write_text(json.dumps(seal({k: v for k, v in manifest.items() if k != "checksum"})))
    result = run_cli("train", "--data-dir", str(data_dir), "--run-dir", str(tmp_path / "r"), "--epochs", "1")
    assert "train split has no 'covid-19' image for task chest3" in clear_error(result)
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ N7, N8b, 7.4: the run folder


@pytest.mark.slow
def test_a_second_train_into_a_folder_in_use_stops_at_once_and_a_dead_holder_does_not_block(synthetic_data, tmp_path):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "epoch-0001-abcd").mkdir()  # the first run's work, which a second one must not delete
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from covidxray.train.run_guard import RunLock; "
            "lock = RunLock(Path(sys.argv[1])); assert lock.acquire() is None; print('held', flush=True); time.sleep(600)",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_cli("train", "--data-dir", str(synthetic_data), "--run-dir", str(run_dir), "--epochs", "1")
        message = clear_error(result)
        assert f"is in use by another `covidxray train` (host {os.uname().nodename}, pid {holder.pid}," in message
        assert (checkpoints / "epoch-0001-abcd").is_dir()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    result = run_cli("train", "--data-dir", str(synthetic_data), "--run-dir", str(run_dir), "--epochs", "1")
    assert result.returncode == 0, result.stderr[-3000:]  # the killed holder's lock file is taken over
    assert json.loads((run_dir / "train_log.json").read_text())["epochs"][0]["epoch"] == 1
    assert not (run_dir / "train.lock").exists()


def test_resume_without_the_recorded_inputs_refuses_unless_forced(synthetic_data, tmp_path):
    from covidxray.run_folder import write_latest
    from covidxray.train.distributed import World
    from covidxray.train.run_guard import check_before_training

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "epoch-0002-abcd").mkdir(parents=True)
    write_latest(run_dir, {"epoch": 2, "path": "epoch-0002-abcd"})
    config = load_config(None, [{"data": {"data_dir": str(synthetic_data)}, "train": {"run_dir": str(run_dir)}}])
    data = open_prepared(synthetic_data)
    with pytest.raises(UserError, match=r"run_inputs.json is missing, .* --resume --force"):
        check_before_training(World(), config, data, {}, resume=True, force=False, say=print)
    with check_before_training(World(), config, data, {}, resume=True, force=True, say=print):
        assert (run_dir / "run_inputs.json").is_file()  # recorded now, for the next resume


def test_resume_names_a_deleted_checkpoint_folder(tmp_path):
    from covidxray.run_folder import write_latest
    from covidxray.train.trainer import _restore

    (tmp_path / "checkpoints").mkdir()
    write_latest(tmp_path, {"epoch": 3, "path": "epoch-0003-abcd"})
    with pytest.raises(UserError, match="names checkpoint epoch-0003-abcd, but that folder is missing"):
        _restore(tmp_path, checkpoint=None)


# ------------------------------------------------------------------ S5b: credentials in a URL


def test_a_password_in_a_mirror_url_is_used_and_never_shown(talo, tmp_path):
    from covidxray.sources.download import download

    archive = zip_tree(talo, tmp_path / "good.zip", prefix="COVID-19-master")
    said: list[str] = []
    with FileServer({"/good.zip": archive.read_bytes()}) as server:
        server.password = "mirroruser:SECRETPASS5"
        url = server.url("/good.zip").replace("http://", "http://mirroruser:SECRETPASS5@")
        path, _ = download(url, tmp_path / "dl" / "good.zip", say=said.append)
        assert path.read_bytes() == archive.read_bytes()
        with pytest.raises(UserError, match=r"HTTP 401 .*user name and password in the URL were not accepted") as err:
            download(url.replace("SECRETPASS5", "WRONGPASS7"), tmp_path / "dl2" / "good.zip", say=said.append)
        assert len(server.requests) == 2  # a refusal is not retried
        assert "WRONGPASS7" not in str(err.value)

        data_dir = tmp_path / "data"
        result = run_cli(
            "prepare",
            "--source",
            "covid19-talo",
            "--set",
            f"data.sources.covid19-talo.url={url}",
            "--data-dir",
            str(data_dir),
            "--image-size",
            "32",
            "--workers",
            "1",
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "***@127.0.0.1" in result.stderr
    shown = [*said, result.stdout, result.stderr]
    written = [p.read_bytes() for p in data_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".csv", ".yaml")]
    assert not any("SECRETPASS5" in text for text in shown) and not any(b"SECRETPASS5" in b for b in written)
    assert open_prepared(data_dir).manifest.data_config["sources"]["covid19-talo"]["url"].startswith("http://***@")


# ------------------------------------------------------------------ 1.8, 4.3: archives


def test_a_tar_gz_whose_one_member_is_a_bomb_is_refused_although_the_archive_overall_is_not(tmp_path):
    archive = tmp_path / "COVID-19-master.tar.gz"
    with tarfile.open(archive, "w:gz") as bundle:
        for name, data in (("noise.bin", os.urandom(3 << 20)), ("zeros.bin", bytes(96 << 20))):
            info = tarfile.TarInfo(f"COVID-19-master/{name}")
            info.size = len(data)
            bundle.addfile(info, io.BytesIO(data))
    overall = (99 << 20) / archive.stat().st_size
    assert 20 < overall < 100  # below the overall limit: only the per-member rule can catch it
    with pytest.raises(
        UserError, match=r"member 'COVID-19-master/zeros.bin' expands \d+x .* max_compression_ratio 100"
    ):
        extract(archive, tmp_path / "out", lambda _: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    extract(archive, tmp_path / "allowed", lambda _: None, limits=ExtractLimits(max_bytes=1 << 30, max_ratio=5000))
    assert (tmp_path / "allowed" / "COVID-19-master" / "zeros.bin").stat().st_size == 96 << 20


def test_a_full_disk_during_extraction_names_the_folder_it_unpacks_into(talo, tmp_path, monkeypatch):
    from covidxray.sources import archive as archive_module

    genuine = zip_tree(talo, tmp_path / "archives" / "talo.zip")
    monkeypatch.setattr(archive_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(UserError, match=r"free on the disk of .*/data/x.partial \(where it unpacks, in --data-dir\)"):
        extract(genuine, tmp_path / "data" / "x", lambda _: None)


# ------------------------------------------------------------------ 4.4: a full disk after the shards


def tables_agree(data_dir: Path) -> None:
    """splits.csv, dropped.csv and duplicates.csv are the ones the live manifest records, and splits.csv holds its split."""
    manifest = open_prepared(data_dir).manifest.to_json()
    assert {name: sha256_file(data_dir / name) for name in TABLES} == manifest[TABLE_SHA256]
    with open(data_dir / SPLIT_TABLE, newline="") as handle:
        per_split = Counter(row["split"] for row in csv.DictReader(handle))
    assert {s: per_split.get(s, 0) for s in manifest["splits"]} == {
        s: info["records"] for s, info in manifest["splits"].items()
    }


@pytest.mark.parametrize("failing", ["splits.csv", "dropped.csv", "duplicates.csv", "manifest.json"])
def test_a_disk_full_at_any_write_after_the_shards_leaves_tables_and_manifest_in_agreement(
    talo, tmp_path, monkeypatch, failing
):
    import builtins

    data_dir = tmp_path / "data"
    reference = prepare(talo_config(data_dir, talo), log=lambda _: None).to_json()
    tables_agree(data_dir)
    real_open = builtins.open

    def full_disk(file, mode="r", *args, **kwargs):
        if "w" in mode and Path(file).name == f"{failing}.partial":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(UserError, match="No space left on device.*previous data set there, if any, is untouched"):
        prepare(talo_config(data_dir, talo, records_per_shard=3, seed=5), log=lambda _: None)
    monkeypatch.setattr(builtins, "open", real_open)
    assert open_prepared(data_dir).manifest.to_json() == reference
    tables_agree(data_dir)
    assert not list(data_dir.glob("*.partial"))
    prepare(talo_config(data_dir, talo, records_per_shard=3, seed=5), log=lambda _: None)
    tables_agree(data_dir)


def test_tables_left_behind_by_a_stop_right_after_the_switch_are_caught(talo, tmp_path, monkeypatch):
    """The one window left (killed between the manifest rename and the tables' renames): audit and doctor see it."""
    from covidxray.data import prepare as prepare_module
    from covidxray.data.audit import audit
    from covidxray.doctor import check_shards

    data_dir = tmp_path / "data"
    prepare(talo_config(data_dir, talo), log=lambda _: None)
    monkeypatch.setattr(prepare_module, "publish", lambda staged, path: None)  # as if killed before the renames
    prepare(talo_config(data_dir, talo, seed=5), log=lambda _: None)
    assert SPLIT_TABLE in check_shards(data_dir)["tables_mismatch"]  # the split changed with the seed
    with pytest.raises(UserError, match=r"splits.csv is not the one .*manifest.json records"):
        audit(data_dir, load_config(None).data, log=lambda _: None)


# ------------------------------------------------------------------ N18c: audit


def test_audit_reads_a_set_prepared_from_a_relative_source_from_anywhere(talo, tmp_path, monkeypatch):
    from covidxray.data.audit import audit

    monkeypatch.chdir(talo.parent)
    data_dir = tmp_path / "data"
    prepare(talo_config(data_dir, Path(talo.name)), log=lambda _: None)
    monkeypatch.chdir(tmp_path / "data")
    lines: list[str] = []
    assert audit(data_dir, load_config(None).data, log=lines.append) == []
    with open(data_dir / SPLIT_TABLE, newline="") as handle:
        images = [row["image"] for row in csv.DictReader(handle)]
    assert all(Path(image).is_absolute() and Path(image).is_file() for image in images)


def test_audit_that_cannot_read_every_image_fails_with_the_count(talo, tmp_path, monkeypatch):
    """An older set with relative paths, audited from another folder, and a deleted image: never a clean exit 0."""
    from covidxray.data.audit import audit

    data_dir = tmp_path / "data"
    manifest = prepare(talo_config(data_dir, talo), log=lambda _: None).to_json()
    with open(data_dir / SPLIT_TABLE, newline="") as handle:
        rows = list(csv.reader(handle))
    for row in rows[1:]:
        row[-1] = os.path.relpath(
            row[-1], tmp_path
        )  # as prepare wrote it when run in tmp_path with a relative --source
    with open(data_dir / SPLIT_TABLE, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    del manifest["checksum"]
    manifest[TABLE_SHA256][SPLIT_TABLE] = sha256_file(data_dir / SPLIT_TABLE)
    (data_dir / "manifest.json").write_text(json.dumps(seal(manifest)))
    monkeypatch.chdir(talo)
    total = len(rows) - 1
    with pytest.raises(UserError, match=rf"{total} of {total} image\(s\) could not be read, .* relative to the folder"):
        audit(data_dir, load_config(None).data, log=lambda _: None)
    monkeypatch.chdir(tmp_path)
    assert audit(data_dir, load_config(None).data, log=lambda _: None) == []  # from the folder prepare ran in: whole
    Path(rows[1][-1]).unlink()
    with pytest.raises(UserError, match=rf"1 of {total} image\(s\) could not be read, so the audit is incomplete"):
        audit(data_dir, load_config(None).data, log=lambda _: None)
    result = run_cli("audit", str(data_dir), cwd=tmp_path)
    assert "could not be read, so the audit is incomplete" in clear_error(result)


# ------------------------------------------------------------------ N19b: doctor


def test_doctor_names_a_damaged_shard_instead_of_blaming_memory(talo, tmp_path):
    from covidxray.doctor import diagnose

    data_dir = tmp_path / "data"
    manifest = prepare(talo_config(data_dir, talo), log=lambda _: None).to_json()
    shard = data_dir / "shards" / next(s["file"] for s in manifest["shards"] if s["split"] == "train")
    with open(shard, "r+b") as handle:
        handle.truncate(200)
    report = diagnose(data_dir, memory_probe=True)
    checks = {c["name"]: c for c in report["checks"]}
    assert (
        not checks["shards match manifest sha256"]["ok"]
        and shard.name in checks["shards match manifest sha256"]["detail"]
    )
    fits = checks["fits this board"]
    assert "not measured: the data set is damaged" in fits["detail"] and "memory" not in fits["detail"]
    assert report["training_memory"] is None  # no probe ran on the damaged shard
