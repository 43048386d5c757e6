"""Duplicate detection: what counts as the same image, which copy stays, and whose patient it is."""

from __future__ import annotations

import itertools
from pathlib import Path

import cv2
import numpy as np

from covidxray.data import dedup, preprocess
from covidxray.sources.base import Record
from layouts import write_image, xray


def hashes_of(path: Path, size: int = 64) -> tuple[bytes, bytes]:
    gray = preprocess.load_gray(path)
    return dedup.pixel_digest(gray), dedup.perceptual_hash(preprocess.resize_square(gray, size))


def test_exact_means_same_pixels_not_same_bytes(tmp_path):
    pixels = xray(7)
    files = []
    for name, params in (("a.png", [cv2.IMWRITE_PNG_COMPRESSION, 1]), ("b.png", [cv2.IMWRITE_PNG_COMPRESSION, 9]), ("c.bmp", []), ("d.tiff", [])):
        ok, data = cv2.imencode(Path(name).suffix, pixels, params)
        (tmp_path / name).write_bytes(data.tobytes())
        files.append(tmp_path / name)
    assert len({f.read_bytes() for f in files}) == 4
    assert len({hashes_of(f)[0] for f in files}) == 1
    changed = pixels.copy()
    changed[10, 10] ^= 1  # one gray level in one pixel is another image
    assert dedup.pixel_digest(changed) != dedup.pixel_digest(pixels)


def test_perceptual_hash_tolerates_reencoding_and_rescaling_only(tmp_path):
    original = xray(11, size=256)
    reference = dedup.perceptual_hash(preprocess.resize_square(original, 128))
    for scale, quality in ((0.5, 70), (1.0, 40), (1.7, 85)):
        size = int(256 * scale)
        ok, data = cv2.imencode(".jpg", cv2.resize(original, (size, size), interpolation=cv2.INTER_AREA), [cv2.IMWRITE_JPEG_QUALITY, quality])
        copy = preprocess.resize_square(cv2.imdecode(data, cv2.IMREAD_GRAYSCALE), 128)
        assert dedup.hamming(reference, dedup.perceptual_hash(copy)) <= 6
    others = [dedup.perceptual_hash(preprocess.resize_square(xray(seed, size=256), 128)) for seed in range(20, 40)]
    assert min(dedup.hamming(a, b) for a, b in itertools.combinations(others + [reference], 2)) > 40


def test_near_pairs_finds_exactly_what_brute_force_finds():
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 256, (400, 32), dtype=np.uint8)
    for i in range(0, 60, 3):  # plant near copies: flip up to 12 bits of another hash
        bits = np.unpackbits(hashes[i + 200])
        bits[rng.choice(256, size=int(rng.integers(0, 13)), replace=False)] ^= 1
        hashes[i] = np.packbits(bits)
    brute = sorted(
        (i, j, d)
        for i, j in itertools.combinations(range(len(hashes)), 2)
        if (d := dedup.hamming(hashes[i].tobytes(), hashes[j].tobytes())) <= 12
    )
    assert len(brute) >= 20
    assert dedup.near_pairs(hashes, 12) == brute
    assert dedup.near_pairs(hashes, -1) == []


def _record(source: str, name: str, patient: str) -> Record:
    return Record(image=Path(f"/data/{source}/{name}"), label="normal", patient_id=f"{source}:{patient}", source=source)


def test_copies_across_sources_keep_the_original_and_merge_patients(tmp_path):
    a, b, c, near = (write_image(tmp_path / n, seed=s) for n, s in (("a.png", 1), ("b.png", 2), ("c.png", 3), ("near.jpg", 1)))
    near.write_bytes(cv2.imencode(".jpg", cv2.resize(cv2.imread(str(a), 0), (80, 80)), [cv2.IMWRITE_JPEG_QUALITY, 70])[1].tobytes())
    followup = tmp_path / "followup.jpg"
    followup.write_bytes(cv2.imencode(".jpg", cv2.imread(str(a), 0), [cv2.IMWRITE_JPEG_QUALITY, 50])[1].tobytes())
    files = {"orig-a": a, "orig-b": b, "copy-a": a, "copy-near": near, "copy-c": c, "orig-a-followup": followup}
    records = [
        _record("original", "orig-a", "p1"),
        _record("original", "orig-b", "p1"),
        _record("original", "orig-a-followup", "p1"),  # near-identical image of the same patient: a follow-up, kept
        _record("copier", "copy-a", "x1"),  # exact copy of orig-a under another patient id
        _record("copier", "copy-near", "x2"),  # re-encoded, rescaled copy of orig-a
        _record("copier", "copy-c", "x1"),  # an image only the copier has
    ]
    hashes = {str(r.image): hashes_of(files[r.image.name]) for r in records}
    result = dedup.deduplicate(records, hashes, {"original": 10, "copier": 30}, max_distance=12)

    kept = {r.image.name: r.patient_id for r in result.kept}
    assert kept == {"orig-a": "original:p1", "orig-b": "original:p1", "orig-a-followup": "original:p1", "copy-c": "original:p1"}
    removed = {d.removed.image.name: (d.kept.image.name, d.kind) for d in result.duplicates}
    assert removed["copy-a"] == ("orig-a", "exact")
    assert removed["copy-near"][1] == "perceptual" and removed["copy-near"][0].startswith("orig-a")
    assert result.merged_patients == {"copier:x1": "original:p1", "copier:x2": "original:p1"}
    summary = result.summary()
    assert summary["by_source"] == {"copier": {"original": 2}} and summary["patients_merged"] == 2
    assert summary["exact"] + summary["perceptual"] == summary["total"] == 2


def test_priority_then_name_decides_and_is_order_independent(tmp_path):
    image = write_image(tmp_path / "same.png", seed=5)
    records = [_record(source, "img", "p") for source in ("zeta", "alpha", "beta")]
    hashes = {str(r.image): hashes_of(image) for r in records}
    for ordering in (records, records[::-1]):
        same_priority = dedup.deduplicate(ordering, hashes, {"zeta": 1, "alpha": 1, "beta": 1}, 12)
        assert [r.source for r in same_priority.kept] == ["alpha"]
        preferred = dedup.deduplicate(ordering, hashes, {"zeta": 0, "alpha": 1, "beta": 1}, 12)
        assert [r.source for r in preferred.kept] == ["zeta"]


def test_exact_only_mode_keeps_near_copies(tmp_path):
    a = write_image(tmp_path / "a.png", seed=1)
    near = tmp_path / "near.jpg"
    near.write_bytes(cv2.imencode(".jpg", cv2.imread(str(a), 0), [cv2.IMWRITE_JPEG_QUALITY, 60])[1].tobytes())
    records = [_record("s", "a", "p1"), _record("s", "near", "p2")]
    hashes = {str(records[0].image): hashes_of(a), str(records[1].image): hashes_of(near)}
    assert len(dedup.deduplicate(records, hashes, {}, max_distance=-1).kept) == 2
    assert len(dedup.deduplicate(records, hashes, {}, max_distance=12).kept) == 1
