"""Bad input, dead workers and damaged files (issue 14): each case builds its own fixture and expects a clear answer.

The table in docs/datasets.md ("Which bad input gets which answer") lists the same cases.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import shutil
import struct
import tarfile
import threading
import time
import zipfile
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from kill_worker import SLOW_DECODE_S, decode_or_die, decode_or_hang
from layouts import build_talo, prepare_config, write_image, xray

from covidxray.config import load_config
from covidxray.data import image_cache, tfrecord
from covidxray.data.prepare import prepare
from covidxray.edge import preprocess
from covidxray.edge.image_header import declared_size
from covidxray.errors import UserError
from covidxray.manifest import open_prepared, shard_problems
from covidxray.sources.archive import ExtractLimits, extract

HANG_BOUND_S = 300  # a hang fails the test instead of the suite


def data_config(data_dir: Path, source_root: Path, **data):
    return prepare_config(data_dir, {"covid19-talo": {"from_path": str(source_root)}}, **data)


@pytest.fixture
def talo(tmp_path) -> Path:
    """A small covid19-talo folder (tests/layouts.py build_talo) as the user has it on disk."""
    return build_talo(tmp_path / "talo").root


@pytest.fixture
def prepared(talo, tmp_path) -> tuple[Path, Path, dict]:
    data_dir = tmp_path / "data"
    return talo, data_dir, prepare(data_config(data_dir, talo), log=lambda _: None).to_json()


def shard_file(data_dir: Path, manifest: dict, index: int = 0) -> Path:
    return data_dir / "shards" / manifest["shards"][index]["file"]


# ------------------------------------------------------------------ decode workers


@pytest.fixture
def images_with_deadly_files(tmp_path) -> list[str]:
    """Ten ordinary images, one that kills its worker the first time and one that kills every worker."""
    names = [f"ok-{i}.png" for i in range(10)] + ["die-once.png", "die-always.png"]
    return [str(write_image(tmp_path / "images" / name, seed=n)) for n, name in enumerate(names)]


def decode_in_a_thread(cache_file: Path, paths: list[str], workers: int, **options) -> tuple[dict, list[str], float]:
    """decode_all at 32 px, bounded by HANG_BOUND_S: (results, log lines, seconds taken)."""
    lines: list[str] = []
    outcome: dict = {}

    def run():
        with image_cache.ImageCache(cache_file) as cache:
            outcome["results"], _ = cache.decode_all(paths, 32, workers, lambda n: None, log=lines.append, **options)

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_BOUND_S)
    assert not worker.is_alive(), "decode hung"
    return outcome["results"], lines, time.monotonic() - started


def direct_decode(path: str) -> image_cache.Decoded:
    """The oracle: the file decoded in this process, by the real decoder."""
    return image_cache.decode_one((path, 32, preprocess.DEFAULT_MAX_PIXELS))[2]


def test_a_killed_decode_worker_is_retried_alone_then_its_file_is_dropped_by_name(images_with_deadly_files, tmp_path):
    results, lines, _ = decode_in_a_thread(tmp_path / "cache.sqlite", images_with_deadly_files, 2, decode=decode_or_die)
    deadly = images_with_deadly_files[-1]
    assert results[deadly].reason == "worker-died" and "killed twice" in results[deadly].detail
    assert any("decode worker died" in line and deadly in line for line in lines)
    assert any(line.startswith(f"skipped {deadly}") for line in lines)
    for path in images_with_deadly_files[:-1]:  # everything else, the once-deadly file included, decoded as in-process
        assert results[path] == direct_decode(path) and results[path].ok


@pytest.fixture
def images_with_hanging_files(tmp_path) -> list[str]:
    """Ten ordinary images, one whose decode hangs the first time and one whose decode always hangs."""
    names = [f"ok-{i}.png" for i in range(10)] + ["hang-once.png", "hang-always.png"]
    return [str(write_image(tmp_path / "images" / name, seed=n)) for n, name in enumerate(names)]


def test_a_hanging_decode_is_stopped_retried_alone_then_its_file_is_dropped_by_name(
    images_with_hanging_files, tmp_path
):
    limit = 1.5
    cache_file = tmp_path / "cache.sqlite"
    results, lines, seconds = decode_in_a_thread(
        cache_file, images_with_hanging_files, 2, decode=decode_or_hang, timeout_s=limit
    )
    # Each hanging file costs the limit twice (in the pool, then alone); the rest is pool start-ups and ms decodes.
    assert seconds < 4 * limit + 30
    stuck, once = images_with_hanging_files[-1], images_with_hanging_files[-2]
    assert results[stuck].reason == "decode-timeout" and "data.decode_timeout_s (1.5 s)" in results[stuck].detail
    for path in (stuck, once):  # named as soon as they pass the limit
        assert any(line.startswith(f"{path}: still decoding after data.decode_timeout_s") for line in lines)
    assert any(line.startswith(f"skipped {stuck}: decoding took longer") for line in lines)
    assert not any(line.startswith(f"skipped {once}") for line in lines)
    for path in images_with_hanging_files[:-1]:  # everything else, the once-hanging file included, decoded correctly
        assert results[path] == direct_decode(path) and results[path].ok
    # A time-out depends on the limit and the board's load, not on the file: a re-run decodes it again.
    results, _, _ = decode_in_a_thread(cache_file, [stuck], 2, timeout_s=limit)
    assert results[stuck] == direct_decode(stuck) and results[stuck].ok


def test_the_decode_limit_counts_from_the_start_of_each_file_not_from_its_submission(tmp_path):
    """Two workers hold two files each: the second file of a worker waits SLOW_DECODE_S before it starts."""
    paths = [str(write_image(tmp_path / "images" / f"slow-{i}.png", seed=i)) for i in range(4)]
    results, lines, _ = decode_in_a_thread(
        tmp_path / "cache.sqlite", paths, 2, decode=decode_or_hang, timeout_s=SLOW_DECODE_S + 1.0
    )
    assert not [line for line in lines if "still decoding" in line]
    assert all(results[path] == direct_decode(path) and results[path].ok for path in paths)


def test_with_one_worker_a_decode_over_the_limit_is_named_though_it_cannot_be_stopped(tmp_path):
    """workers 1 decodes in the calling process: nothing to kill, but the user learns which file is slow."""
    slow = str(write_image(tmp_path / "images" / "slow-0.png", seed=0))
    results, lines, _ = decode_in_a_thread(
        tmp_path / "cache.sqlite", [slow], 1, decode=decode_or_hang, timeout_s=SLOW_DECODE_S / 3
    )
    assert [line for line in lines if line.startswith(f"{slow}: still decoding")] == lines and len(lines) == 1
    assert "cannot be stopped" in lines[0] and "data.workers" in lines[0]
    assert results[slow] == direct_decode(slow) and results[slow].ok


def test_prepare_drops_a_file_whose_decode_hangs_counts_it_and_lists_it(talo, tmp_path, monkeypatch):
    stuck = write_image(talo / "X-Ray Image DataSet" / "No_findings" / "hang-always.png", seed=99)
    monkeypatch.setattr(image_cache, "decode_one", decode_or_hang)  # what prepare hands to its workers
    lines: list[str] = []
    data_dir = tmp_path / "data"
    manifest = prepare(data_config(data_dir, talo, workers=2, decode_timeout_s=1.0), log=lines.append).to_json()
    assert manifest["dropped"]["covid19-talo: image decode-timeout"] == 1
    with open(data_dir / "dropped.csv", newline="") as table:
        rows = [row for row in csv.DictReader(table) if "decode-timeout" in row["reason"]]
    assert [(row["reason"], row["where"]) for row in rows] == [("image decode-timeout", str(stuck))]
    assert any(line.startswith("skipped 1 file(s) (covid19-talo: image decode-timeout)") for line in lines)
    others = [p for p in talo.rglob("*") if p.suffix in (".png", ".jpg", ".jpeg") and p != stuck]
    assert sum(shard["records"] for shard in manifest["shards"]) == len(others)  # every other image decoded


@pytest.mark.parametrize("limit", [-1, -0.5])
def test_a_negative_decode_limit_is_refused_naming_the_key(limit):
    with pytest.raises(UserError, match=r"data\.decode_timeout_s: .* is below the minimum 0"):
        load_config(None, [{"data": {"decode_timeout_s": limit}}])


def test_a_decode_limit_of_zero_means_no_limit(tmp_path):
    assert load_config(None, [{"data": {"decode_timeout_s": 0}}]).data.decode_timeout_s == 0
    paths = [str(write_image(tmp_path / "images" / f"slow-{i}.png", seed=i)) for i in range(2)]
    results, lines, _ = decode_in_a_thread(tmp_path / "cache.sqlite", paths, 2, decode=decode_or_hang, timeout_s=0)
    assert not lines and all(results[path] == direct_decode(path) for path in paths)


# ------------------------------------------------------------------ file names


LATIN1_NAME = b"00001290_000-caf\xe9.png"  # not UTF-8: a Latin-1 e-acute


@pytest.fixture
def talo_with_latin1_names(talo, tmp_path) -> tuple[Path, Path]:
    """The talo folder with a Latin-1 file name on disk, and the same tree as a tar.gz made with Latin-1 names."""
    folder = talo / "X-Ray Image DataSet" / "No_findings"
    write_image(Path(os.fsdecode(os.path.join(os.fsencode(folder), LATIN1_NAME))), seed=4242)
    archive = tmp_path / "COVID-19-master.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.GNU_FORMAT, encoding="latin-1") as bundle:
        bundle.add(talo, arcname=talo.name)
    with tarfile.open(archive, encoding="latin-1") as bundle:
        assert any(m.name.endswith("caf\xe9.png") for m in bundle)  # really stored as Latin-1 bytes
    return talo, archive


@pytest.mark.parametrize("given", ["folder", "tar.gz"])
def test_a_file_name_that_is_not_utf8_is_prepared_like_any_other(talo_with_latin1_names, tmp_path, given):
    folder, archive = talo_with_latin1_names
    data_dir = tmp_path / "data"
    manifest = prepare(data_config(data_dir, folder if given == "folder" else archive), log=lambda _: None).to_json()
    images_on_disk = [
        p for p in folder.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg") and not p.name.startswith(".")
    ]
    assert sum(s["records"] for s in manifest["shards"]) == len(
        images_on_disk
    )  # build_talo's images and the Latin-1 one
    records = tfrecord.read_records([data_dir / "shards" / s["file"] for s in manifest["shards"]])
    assert any(
        ":00001290_000-caf\udce9.png:" in r["record_id"] for r in records
    )  # the name's own bytes, surrogate-escaped
    assert (
        "00001290_000-caf\\udce9.png" in (data_dir / "splits.csv").read_text()
    )  # the table stays UTF-8, the byte shown escaped


@pytest.fixture
def real_talo_with_a_latin1_name(shared_data, tmp_path) -> tuple[Path, bytes]:
    """The real talo sample with one NIH radiograph renamed to a Latin-1 (not UTF-8) name."""
    root = Path(shutil.copytree(shared_data / "covid19-talo-sample", tmp_path / "talo"))
    folder = root / "X-Ray Image DataSet" / "No_findings"
    original = sorted(folder.iterdir())[0]
    renamed = os.path.join(os.fsencode(folder), original.stem.encode() + b"-caf\xe9.png")
    os.rename(original, renamed)
    return root, renamed


def test_the_real_talo_sample_with_a_latin1_name_prepares_in_two_workers(real_talo_with_a_latin1_name, tmp_path):
    root, renamed = real_talo_with_a_latin1_name
    data_dir = tmp_path / "data"
    manifest = prepare(data_config(data_dir, root, workers=2, image_size=64), log=lambda _: None).to_json()
    assert sum(s["records"] for s in manifest["shards"]) == 24
    name = os.fsdecode(os.path.basename(renamed))
    (record,) = [
        r
        for r in tfrecord.read_records(data_dir / "shards" / s["file"] for s in manifest["shards"])
        if f":{name}:" in r["record_id"]
    ]
    gray = cv2.imdecode(
        np.fromfile(os.fsdecode(renamed), np.uint8), cv2.IMREAD_GRAYSCALE
    )  # decoded independently of prepare
    assert np.array_equal(record["image"][:, :, 0], cv2.resize(gray, (64, 64), interpolation=cv2.INTER_AREA))


# ------------------------------------------------------------------ pixel counts


def _png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose IHDR declares width x height 8-bit gray, with a few real rows of data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = zlib.compress(b"".join(b"\0" + bytes(width) for _ in range(4)))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", rows)
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def pixel_bombs(tmp_path) -> dict[str, Path]:
    bombs = {"30000x30000": tmp_path / "bomb-30000.png", "16000x16000": tmp_path / "bomb-16000.png"}
    bombs["30000x30000"].write_bytes(_png_declaring(30000, 30000))
    bombs["16000x16000"].write_bytes(_png_declaring(16000, 16000))
    return bombs


def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(pixel_bombs):
    for size, path in pixel_bombs.items():
        assert path.stat().st_size < 100_000
        with pytest.raises(preprocess.ImageError, match=f"header declares {size}") as caught:
            preprocess.load_gray(path)  # predict's decode path too
        assert caught.value.reason == "too-large" and "data.max_pixels" in str(caught.value)
        _, png, decoded = image_cache.decode_one((str(path), 32, preprocess.DEFAULT_MAX_PIXELS))  # prepare's
        assert png is None and decoded.reason == "too-large"


def test_raising_max_pixels_takes_effect_on_the_next_run_despite_the_decode_cache(tmp_path):
    """A refusal that depends on a limit is not cached: the user told to raise data.max_pixels must see it work."""
    path = tmp_path / "big.png"
    cv2.imwrite(str(path), xray(1, 300))
    cache_file = tmp_path / "cache.sqlite"
    results, _, _ = decode_in_a_thread(cache_file, [str(path)], 1, max_pixels=300 * 300 - 1)
    assert results[str(path)].reason == "too-large"
    results, _, _ = decode_in_a_thread(cache_file, [str(path)], 1, max_pixels=300 * 300)
    assert results[str(path)].ok and results[str(path)].pixel_sha256 == direct_decode(str(path)).pixel_sha256


def test_max_pixels_is_configurable_and_checked_after_decoding_too(tmp_path):
    path = tmp_path / "big.png"
    cv2.imwrite(str(path), xray(1, 300))
    assert preprocess.load_gray(path, max_pixels=300 * 300).shape == (300, 300)
    with pytest.raises(preprocess.ImageError, match="300x300 = 90,000 pixels"):
        preprocess.load_gray(path, max_pixels=300 * 300 - 1)
    with pytest.raises(Exception, match="max_pixels"):
        load_config(None, [{"data": {"max_pixels": 0}}])


@pytest.fixture
def headers(tmp_path, shared_data) -> dict[Path, tuple[int, int]]:
    """Files of every parsed format with their true size from the decoders (cv2, pydicom): the oracle."""
    import pydicom

    files = {}
    for n, (suffix, shape) in enumerate(
        [(".png", (37, 91)), (".jpg", (120, 33)), (".bmp", (50, 70)), (".tif", (64, 48)), (".png", (20, 5000))]
    ):
        path = tmp_path / f"h{n}{suffix}"
        cv2.imwrite(str(path), np.full(shape, 100, np.uint8))
        files[path] = (shape[1], shape[0])
    originals = sorted((shared_data / "chest-xray-pneumonia-originals").rglob("*.jpeg"))[:6]
    for path in originals:
        height, width = cv2.imread(str(path), cv2.IMREAD_UNCHANGED).shape[:2]
        files[path] = (width, height)
    for path in sorted(
        p for p in (shared_data / "dicom").glob("*") if preprocess.is_dicom(p)
    ):  # what load_gray reads as DICOM
        dataset = pydicom.dcmread(str(path), force=True)
        files[path] = (
            int(dataset.Columns),
            int(dataset.Rows) * int(dataset.get("NumberOfFrames", 1) or 1) * int(dataset.get("SamplesPerPixel", 1)),
        )
    return files


def test_header_sizes_agree_with_the_decoders_on_real_files(headers):
    for path, size in headers.items():
        assert declared_size(path, preprocess.is_dicom(path)) == size, path


# ------------------------------------------------------------------ archives


@pytest.fixture
def zip_bomb(tmp_path) -> Path:
    """A 64 MiB member of zeros that deflates ~1000x, beside a real image."""
    archive = tmp_path / "COVID-19-master.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr(
            "COVID-19-master/X-Ray Image DataSet/No_findings/00000001_000.png",
            cv2.imencode(".png", xray(1))[1].tobytes(),
        )
        bundle.writestr("COVID-19-master/X-Ray Image DataSet/No_findings/00000002_000.png", bytes(64 << 20))
    assert archive.stat().st_size < 1 << 20
    return archive


def test_a_zip_bomb_is_refused_before_anything_is_written(zip_bomb, tmp_path):
    target = tmp_path / "out"
    with pytest.raises(UserError, match=r"member .*00000002_000.png' expands \d+x .* above max_compression_ratio 100"):
        extract(zip_bomb, target, lambda _: None)
    assert not target.exists() and not target.with_name("out.partial").exists()


@pytest.fixture
def tar_bomb(tmp_path) -> Path:
    archive = tmp_path / "OCT2017.tar.gz"
    with tarfile.open(archive, "w:gz") as bundle:
        info = tarfile.TarInfo("OCT2017/train/zeros.bin")
        info.size = 64 << 20
        bundle.addfile(info, io.BytesIO(bytes(info.size)))
    return archive


def test_a_tar_gz_bomb_and_an_oversized_archive_are_refused_with_the_setting_to_change(tar_bomb, talo, tmp_path):
    with pytest.raises(UserError, match=r"expands to more than 100x its own .* raise max_compression_ratio"):
        extract(tar_bomb, tmp_path / "oct", lambda _: None)
    genuine = shutil.make_archive(str(tmp_path / "talo"), "zip", talo)
    with pytest.raises(UserError, match="more than max_extract_bytes 1,000 bytes"):
        extract(
            Path(genuine), tmp_path / "talo-out", lambda _: None, limits=ExtractLimits(max_bytes=1000, max_ratio=100)
        )
    with pytest.raises(
        UserError, match="max_extract_bytes"
    ):  # the configured limit reaches the adapters through prepare
        prepare(data_config(tmp_path / "data", Path(genuine), max_extract_bytes=1000), log=lambda _: None)


# ------------------------------------------------------------------ damaged files of a prepared set


def test_a_corrupt_decode_cache_is_set_aside_and_rebuilt(prepared):
    talo, data_dir, reference = prepared
    (cache,) = (data_dir / "cache").glob("*.sqlite")
    cache.write_bytes(b"this is not an SQLite database" * 100)
    lines: list[str] = []
    again = prepare(data_config(data_dir, talo), log=lines.append).to_json()
    assert any("decode cache" in line and "damaged" in line and "rebuilding" in line for line in lines)
    assert again["shards"] == reference["shards"]
    assert cache.with_name(cache.name + ".damaged").is_file()


def test_an_empty_receipt_makes_prepare_rewrite_its_shard(prepared):
    talo, data_dir, reference = prepared
    shard_file(data_dir, reference).with_suffix(".json").write_bytes(b"")
    lines: list[str] = []
    again = prepare(data_config(data_dir, talo), log=lines.append).to_json()
    assert any("receipt" in line and "damaged" in line for line in lines)
    assert again["shards_reused"] == len(reference["shards"]) - 1 and again["shards"] == reference["shards"]


def test_a_bit_flipped_shard_is_refused_by_train_and_repaired_by_prepare(prepared):
    from conftest import run_cli

    talo, data_dir, reference = prepared
    shard = shard_file(data_dir, reference)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    result = run_cli("train", "--data-dir", str(data_dir), "--run-dir", str(data_dir.parent / "run"), "--epochs", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"damaged (sha256 differs from manifest.json): {shard.name}" in " ".join(result.stderr.split())
    assert not (data_dir.parent / "run" / "model.keras").exists()
    lines: list[str] = []
    repaired = prepare(data_config(data_dir, talo), log=lines.append).to_json()
    assert any(shard.name in line and "damaged" in line for line in lines)
    assert repaired["shards"] == reference["shards"] and shard_problems(open_prepared(data_dir)) == {
        "missing": [],
        "sha256_mismatch": [],
    }


def test_a_truncated_manifest_says_what_to_run(prepared):
    _, data_dir, _ = prepared
    manifest = data_dir / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:200])
    with pytest.raises(
        UserError, match=r"manifest.json is damaged \(truncated or not JSON.*re-run `covidxray prepare`"
    ):
        open_prepared(data_dir)


def test_an_edited_manifest_is_refused_and_doctor_flags_it(prepared):
    from covidxray.doctor import diagnose

    _, data_dir, reference = prepared
    edited = {**reference, "labels": list(reversed(reference["labels"]))}
    (data_dir / "manifest.json").write_text(
        json.dumps({**edited, "checksum": json.loads((data_dir / "manifest.json").read_text())["checksum"]}, indent=2)
    )
    with pytest.raises(UserError, match="was changed after prepare wrote it"):
        open_prepared(data_dir)
    report = diagnose(data_dir)
    (check,) = [c for c in report["checks"] if c["name"].startswith("manifest intact")]
    assert not check["ok"] and check["required"] and "changed after prepare" in check["detail"] and not report["ok"]


# ------------------------------------------------------------------ re-prepare and content


@pytest.fixture
def grown_talo(prepared):
    """The prepared talo folder with four more images: a re-prepare plans different shards."""
    talo, data_dir, reference = prepared
    for n in range(4):
        write_image(talo / "X-Ray Image DataSet" / "Pneumonia" / f"0000900{n}_000.png", seed=900 + n)
    return talo, data_dir, reference


def test_a_reprepare_that_runs_out_of_disk_leaves_the_old_set_whole_and_trusted(grown_talo, monkeypatch):
    talo, data_dir, reference = grown_talo
    real_write = tfrecord.write_shard
    calls = []

    def full_disk(path, examples):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, examples)

    monkeypatch.setattr(tfrecord, "write_shard", full_disk)
    with pytest.raises(UserError, match="No space left on device.*previous data set there, if any, is untouched"):
        prepare(data_config(data_dir, talo), log=lambda _: None)
    old = open_prepared(data_dir)
    assert old.manifest.to_json() == reference
    assert shard_problems(old) == {"missing": [], "sha256_mismatch": []}

    monkeypatch.setattr(tfrecord, "write_shard", real_write)
    new = prepare(data_config(data_dir, talo), log=lambda _: None).to_json()
    assert sum(s["records"] for s in new["shards"]) == sum(s["records"] for s in reference["shards"]) + 4
    assert shard_problems(old) == {
        "missing": [],
        "sha256_mismatch": [],
    }  # a reader of the old set keeps its files
    newest = prepare(data_config(data_dir, talo, seed=1), log=lambda _: None).to_json()
    listed = {s["file"] for s in new["shards"] + newest["shards"]}
    assert {
        p.name for p in (data_dir / "shards").glob("*.tfrecord")
    } == listed  # two generations kept, older ones removed


@pytest.fixture
def bmp_talo(talo) -> Path:
    """A talo folder holding one BMP: same dimensions, same byte size whatever the pixels."""
    write_image(talo / "X-Ray Image DataSet" / "No_findings" / "00000777_000.bmp", seed=1)
    return talo


def test_an_image_replaced_in_place_with_same_size_and_mtime_is_decoded_again(bmp_talo, tmp_path):
    image = bmp_talo / "X-Ray Image DataSet" / "No_findings" / "00000777_000.bmp"
    data_dir = tmp_path / "data"
    prepare(data_config(data_dir, bmp_talo), log=lambda _: None)
    stat = image.stat()
    write_image(image, seed=2)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (image.stat().st_size, image.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    manifest = prepare(data_config(data_dir, bmp_talo), log=lambda _: None).to_json()
    (record,) = [
        r
        for r in tfrecord.read_records(data_dir / "shards" / s["file"] for s in manifest["shards"])
        if "00000777" in r["record_id"]
    ]
    expected = preprocess.resize_square(
        cv2.imread(str(image), cv2.IMREAD_GRAYSCALE), 32
    )  # the new pixels, decoded independently
    assert np.array_equal(record["image"][:, :, 0], expected)


# ------------------------------------------------------------------ train


@pytest.fixture
def run_inputs(prepared, tmp_path):
    """A run folder whose inputs were recorded by a first (non-resumed) start."""
    from covidxray.train.distributed import World
    from covidxray.train.run_guard import check_before_training

    _, data_dir, _ = prepared
    config = load_config(None, [{"data": {"data_dir": str(data_dir)}, "train": {"run_dir": str(tmp_path / "run")}}])
    data = open_prepared(data_dir)
    check_before_training(World(), config, data, {}, resume=False, force=False, say=lambda _: None)
    return config, data_dir, data


def test_resume_refuses_other_settings_or_data_unless_forced(run_inputs, talo, tmp_path):
    from conftest import run_cli

    from covidxray.train.distributed import World
    from covidxray.train.run_guard import RUN_INPUTS, check_before_training

    config, data_dir, data = run_inputs
    result = run_cli(
        "train", "--data-dir", str(data_dir), "--run-dir", config.train.run_dir, "--resume", "--batch-size", "8"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--resume would continue" in result.stderr and "train.batch_size (32 then, 8 now)" in " ".join(
        result.stderr.split()
    )
    config.train.epochs, config.train.batch_size, config.train.learning_rate = 50, 8, 0.01
    with pytest.raises(
        UserError,
        match=r"different train\.batch_size \(32 then, 8 now\); train\.learning_rate \(0\.001 then, 0\.01 now\)\. .*--force",
    ):
        check_before_training(World(), config, data, {}, resume=True, force=False, say=lambda _: None)
    said: list[str] = []
    check_before_training(World(), config, data, {}, resume=True, force=True, say=said.append)
    assert any(line.startswith("--force: resuming") for line in said)
    assert (
        json.loads((Path(config.train.run_dir) / RUN_INPUTS).read_text())["train"]["batch_size"] == 8
    )  # the record follows --force
    prepare(data_config(data_dir, talo), log=lambda _: None)  # a re-prepare of the same data is the same data set
    same_data = open_prepared(data_dir)
    check_before_training(World(), config, same_data, {}, resume=True, force=False, say=lambda _: None)

    other_dir = tmp_path / "other-data"
    prepare(data_config(other_dir, talo, seed=7), log=lambda _: None)
    config.data.data_dir = str(other_dir)
    with pytest.raises(UserError, match=r"different data set \(manifest.json content sha256 \w{12} then, \w{12} now\)"):
        check_before_training(
            World(), config, open_prepared(other_dir), {}, resume=True, force=False, say=lambda _: None
        )


@pytest.mark.parametrize("content", [b"", b'{"epoch": 3, "pa', b"[]"])
def test_a_damaged_latest_json_is_named_instead_of_a_traceback(tmp_path, content):
    from covidxray.train.trainer import _restore

    latest = tmp_path / "checkpoints" / "latest.json"
    latest.parent.mkdir(parents=True)
    latest.write_bytes(content)
    with pytest.raises(UserError, match=r"latest.json is damaged .* start over without --resume"):
        _restore(tmp_path, checkpoint=None)
