"""Duplicate detection: what counts as the same image, which copy stays, and whose patient it is."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from layouts import write_image, xray

from covidxray.config import Config
from covidxray.data import dedup, near_duplicates
from covidxray.edge import preprocess
from covidxray.records import Record


def hashes_of(path: Path, size: int = 64) -> tuple[bytes, bytes]:
    gray = preprocess.load_gray(path)
    return dedup.pixel_digest(gray), dedup.perceptual_hash(preprocess.resize_square(gray, size))


def test_exact_means_same_pixels_not_same_bytes(tmp_path):
    pixels = xray(7)
    files = []
    for name, params in (
        ("a.png", [cv2.IMWRITE_PNG_COMPRESSION, 1]),
        ("b.png", [cv2.IMWRITE_PNG_COMPRESSION, 9]),
        ("c.bmp", []),
        ("d.tiff", []),
    ):
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
        ok, data = cv2.imencode(
            ".jpg",
            cv2.resize(original, (size, size), interpolation=cv2.INTER_AREA),
            [cv2.IMWRITE_JPEG_QUALITY, quality],
        )
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
    a, b, c, near = (
        write_image(tmp_path / n, seed=s) for n, s in (("a.png", 1), ("b.png", 2), ("c.png", 3), ("near.jpg", 1))
    )
    near.write_bytes(
        cv2.imencode(".jpg", cv2.resize(cv2.imread(str(a), 0), (80, 80)), [cv2.IMWRITE_JPEG_QUALITY, 70])[1].tobytes()
    )
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
    assert kept == {
        "orig-a": "original:p1",
        "orig-b": "original:p1",
        "orig-a-followup": "original:p1",
        "copy-c": "original:p1",
    }
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


# ---------------------------------------------------------------- near duplicates on real radiographs

TALO = Path("covid19-talo-sample") / "X-Ray Image DataSet"
IEEE_IMAGES = Path("covid-chestxray-sample") / "covid-chestxray-dataset" / "images"


def _features(gray: np.ndarray) -> near_duplicates.Features:
    return near_duplicates.unpack(near_duplicates.features(gray))


def _confirmed(first: np.ndarray, second: np.ndarray) -> near_duplicates.Match | None:
    a, b = _features(first), _features(second)
    return near_duplicates.verify(a, b, False, MIN_INLIERS) or near_duplicates.verify(a, b, True, MIN_INLIERS)


MIN_INLIERS = Config().data.dedup_min_inliers


def republished(gray: np.ndarray, family: str) -> np.ndarray:
    """One copy per transform family the issue names, at the far end of each range."""
    h, w = gray.shape
    if family == "crop up to 20% per side":
        return gray[h // 5 : h - h // 10, w // 5 : w - w // 20]
    if family == "border":
        return cv2.copyMakeBorder(gray, h // 5, h // 8, w // 6, w // 5, cv2.BORDER_CONSTANT, value=255)
    if family == "rescale 0.25x":
        return cv2.resize(gray, (w // 4, h // 4), interpolation=cv2.INTER_AREA)
    if family == "rescale 4x":
        return cv2.resize(gray, (w * 4, h * 4), interpolation=cv2.INTER_CUBIC)
    if family == "jpeg 40":
        return cv2.imdecode(cv2.imencode(".jpg", gray, [cv2.IMWRITE_JPEG_QUALITY, 40])[1], cv2.IMREAD_GRAYSCALE)
    if family == "gamma 1.6, contrast 0.7":
        return np.clip(255 * (np.arange(256) / 255) ** 1.6 * 0.7 + 20, 0, 255).astype(np.uint8)[gray]
    if family == "text and marker":
        out = gray.copy()
        cv2.putText(out, "PORTABLE  AP", (w // 10, h // 8), cv2.FONT_HERSHEY_SIMPLEX, w / 300, 255, max(1, w // 200))
        cv2.putText(out, "R", (w - w // 6, h // 2), cv2.FONT_HERSHEY_SIMPLEX, w / 200, 255, max(1, w // 150))
        cv2.rectangle(out, (w // 20, h - h // 6), (w // 20 + w // 12, h - h // 6 + h // 12), 0, -1)
        return out
    if family == "rotate 5 deg":
        return cv2.warpAffine(gray, cv2.getRotationMatrix2D((w / 2, h / 2), 5, 1.0), (w, h))
    if family == "flip":
        return cv2.flip(gray, 1)
    raise ValueError(family)


FAMILIES = (
    "crop up to 20% per side",
    "border",
    "rescale 0.25x",
    "rescale 4x",
    "jpeg 40",
    "gamma 1.6, contrast 0.7",
    "text and marker",
    "rotate 5 deg",
    "flip",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_transform_family_is_confirmed_on_real_radiographs(shared_data, family):
    for name in ("00001280_004.png", "00001299_000.png"):
        original = preprocess.load_gray(shared_data / TALO / "No_findings" / name)
        match = _confirmed(original, republished(original, family))
        assert match is not None, f"{family} copy of {name} not confirmed"
        assert match.flipped == (family == "flip")


def test_real_follow_ups_of_one_patient_are_not_confirmed(shared_data):
    # NIH: the same patient's radiographs on different days; ieee8023 patient 19 (metadata.csv): days 10, 13, 17, 25
    pairs = [
        (TALO / "Pneumonia" / "00000061_012.png", TALO / "Pneumonia" / "00000061_015.png"),
        (TALO / "Pneumonia" / "00000211_013.png", TALO / "Pneumonia" / "00000211_018.png"),
    ]
    panels = [IEEE_IMAGES / f"1-s2.0-S0929664620300449-gr2_lrg-{x}.jpg" for x in "abcd"]
    pairs += list(itertools.combinations(panels, 2))
    for first, second in pairs:
        assert (
            _confirmed(preprocess.load_gray(shared_data / first), preprocess.load_gray(shared_data / second)) is None
        ), (first, second)


def test_a_follow_up_under_another_patient_id_is_still_kept(shared_data, tmp_path):
    """Even when two sources name one patient differently, the geometric check does not merge a follow-up."""
    first, second = (shared_data / TALO / "Pneumonia" / n for n in ("00000211_013.png", "00000211_018.png"))
    records = [
        Record(image=first, label="pneumonia", patient_id="a:1", source="a"),
        Record(image=second, label="pneumonia", patient_id="b:1", source="b"),
    ]
    grays = {str(p): preprocess.load_gray(p) for p in (first, second)}
    hashes = {
        k: (dedup.pixel_digest(g), dedup.perceptual_hash(preprocess.resize_square(g, 128))) for k, g in grays.items()
    }
    features = {k: near_duplicates.features(g) for k, g in grays.items()}
    result = dedup.deduplicate(records, hashes, {}, 12, features, MIN_INLIERS)
    assert len(result.kept) == 2 and not result.duplicates


def test_candidate_stage_finds_copies_without_all_pairs_and_no_pair_twice(shared_data):
    names = sorted((shared_data / TALO / "No_findings").iterdir())
    grays = [preprocess.load_gray(p) for p in names]
    copies = [republished(g, "crop up to 20% per side") for g in grays]
    described = [_features(g) for g in grays + copies]
    found = near_duplicates.candidate_pairs(described, per_image=2)
    n = len(grays)
    assert {(i, i + n) for i in range(n)} <= {(i, j) for i, j, _ in found}
    assert len(found) <= 2 * 2 * n  # at most per_image per image, far below the 120 pairs of 16 images
    for threads in (2, 3):  # word columns in threads: the same pairs and votes, in the same order (ties rank by it)
        assert list(near_duplicates.candidate_pairs(described, per_image=2, threads=threads).items()) == list(
            found.items()
        )


def test_pairs_already_joined_are_not_checked_and_the_groups_stay_the_same(shared_data):
    original = preprocess.load_gray(shared_data / TALO / "No_findings" / "00001280_004.png")
    copies = [original] + [republished(original, family) for family in ("crop up to 20% per side", "jpeg 40", "flip")]
    features = [_features(g) for g in copies]

    def groups(pairs) -> set[frozenset[int]]:
        joined = {i: {i} for i in range(len(copies))}
        for i, j in pairs:
            merged = joined[i] | joined[j]
            for k in merged:
                joined[k] = merged
        return {frozenset(g) for g in joined.values()}

    everything = near_duplicates.confirmed_pairs(features, MIN_INLIERS)
    assert groups((i, j) for i, j, _ in everything) == {frozenset(range(4))}
    known = [(0, 2)]  # e.g. the perceptual hash's pair
    rest = near_duplicates.confirmed_pairs(features, MIN_INLIERS, known)
    assert not {(0, 2)} & {(i, j) for i, j, _ in rest}
    assert groups(known + [(i, j) for i, j, _ in rest]) == {frozenset(range(4))}
    assert len(rest) == 2  # a spanning tree: one check per image joined


def test_checks_in_threads_confirm_exactly_the_pairs_of_the_serial_order(shared_data):
    """The oracle is the serial loop: vote order, a pair joined meanwhile skipped. Several copies per original make
    pairs that a better-voted pair of the same window joins first, which the threaded path must discard too."""
    names = sorted((shared_data / TALO / "No_findings").iterdir())[:6]
    originals = [preprocess.load_gray(p) for p in names]
    grays = originals + [republished(g, family) for g in originals for family in FAMILIES[:5]]
    features = [_features(g) for g in grays]
    known = [(0, 6)]  # as the perceptual hash would pass them
    serial = near_duplicates.confirmed_pairs(features, MIN_INLIERS, known)
    assert len(serial) >= len(grays) - len(originals) - len(known)  # the copies were found: not a vacuous comparison
    for threads in (2, 3):
        assert near_duplicates.confirmed_pairs(features, MIN_INLIERS, known, threads=threads) == serial


def test_a_small_image_is_described_at_its_own_size_and_its_copies_still_match(shared_data):
    """Upsampling a 224 px image to SIDE adds only corners of the interpolation: it keeps its size, and its copies
    at 4x (described at SIDE) and cropped (smaller still) are confirmed against it."""
    path = sorted((shared_data / "chest-xray-pneumonia-224" / "chest_xray" / "test" / "NORMAL").glob("*.jpeg"))[0]
    small = preprocess.load_gray(path)
    assert max(small.shape) < near_duplicates.SIDE
    described = _features(small)
    assert (described.height, described.width) == small.shape
    large = republished(small, "rescale 4x")
    assert max(_features(large).width, _features(large).height) == near_duplicates.SIDE
    for family in ("rescale 4x", "crop up to 20% per side"):
        assert _confirmed(small, republished(small, family)) is not None, family


def test_phantoms_of_two_patients_of_one_build_are_not_one_radiograph():
    """Phantoms drawn with the same smooth anatomy (build, lungs, heart) for two patients differ in their ribs only:
    before issue 26 every patient had the same drawn rib arcs, and such pairs fitted one similarity with 35-60
    keypoints, so dedup removed patients' images from the bench's phantom sets."""
    from covidxray.sources import synthetic

    for trial in range(2):
        anatomy = synthetic._patient_anatomy(np.random.default_rng(100 + trial))
        first, second = (
            synthetic.render_phantom(
                "normal",
                dict(anatomy, rib_shapes=synthetic._rib_shapes(np.random.default_rng([0, patient]))),
                1024,
                np.random.default_rng(patient),
            )
            for patient in (1, 2)
        )
        assert _confirmed(first, second) is None, trial


def test_keypoints_are_spread_over_the_grid_before_the_strongest_rest(shared_data):
    """Against a plain reading of the rule: per cell the strongest fair share, all by strength, then the rest by strength."""
    small = cv2.equalizeHist(
        near_duplicates.trim_uniform_border(
            preprocess.load_gray(shared_data / TALO / "No_findings" / "00001299_000.png")
        )
    )
    keypoints = cv2.ORB_create(nfeatures=1536, fastThreshold=5).detect(small, None)
    height, width = small.shape
    grid, share = near_duplicates.GRID, -(-near_duplicates.KEYPOINTS // near_duplicates.GRID**2)
    taken: dict[tuple[int, int], int] = {}
    fair, rest = [], []
    for k in sorted(keypoints, key=lambda k: -k.response):
        cell = (min(grid - 1, int(k.pt[0] * grid / width)), min(grid - 1, int(k.pt[1] * grid / height)))
        taken[cell] = taken.get(cell, 0) + 1
        (fair if taken[cell] <= share else rest).append(k)
    expected = (fair + rest)[: near_duplicates.KEYPOINTS]
    assert [k.pt for k in near_duplicates._spread_out(keypoints, width, height)] == [k.pt for k in expected]


def test_keypoints_touching_full_white_overlays_are_dropped():
    gray = np.full((384, 384), 100, np.uint8)
    gray[100:110, 200:260] = 255  # a burned-in white bar
    points = [
        (230.0, 105.0),
        (230.0, 116.0),
        (230.0, 118.0),
        (50.0, 50.0),
    ]  # on it, 7 px below its last row (inside a 15 px patch), 9 px below, far
    kept = near_duplicates._off_overlays([cv2.KeyPoint(x, y, 15) for x, y in points], gray)
    assert [k.pt for k in kept] == [(230.0, 118.0), (50.0, 50.0)]


def features_with_the_original_glue(gray: np.ndarray) -> bytes:
    """near_duplicates.features with its Python glue as first written (FEATURE_VERSION .../7): keypoints filtered by
    a zip over numpy booleans, positions packed from each k.pt. The oracle for the vectorised glue's blobs."""
    trimmed = near_duplicates.trim_uniform_border(gray)
    small = cv2.createCLAHE(clipLimit=2.0, tileGridSize=(8, 8)).apply(cv2.equalizeHist(trimmed))
    orb = near_duplicates._orb(near_duplicates.CANDIDATE_KEYPOINTS)
    detected = orb.detect(small, None)
    patch = np.ones((near_duplicates.PATCH, near_duplicates.PATCH), np.uint8)
    usable = cv2.erode((trimmed < 255).astype(np.uint8), patch)
    x, y = np.array([k.pt for k in detected]).reshape(-1, 2).astype(int).T
    off_overlays = [k for k, ok in zip(detected, usable[y, x]) if ok]
    keypoints = near_duplicates._spread_out(off_overlays, small.shape[1], small.shape[0])
    keypoints, descriptors = orb.compute(small, keypoints)
    if descriptors is None:
        keypoints, descriptors = [], np.zeros((0, 32), np.uint8)
    width = small.shape[1]
    mirrored_keypoints = [
        cv2.KeyPoint(width - 1 - k.pt[0], k.pt[1], k.size, (180 - k.angle) % 360, k.response, k.octave)
        for k in keypoints
    ]
    kept, mirrored = orb.compute(cv2.flip(small, 1), mirrored_keypoints)
    if len(kept) != len(keypoints):
        mirror_x = {round(k.pt[0], 2) for k in kept}
        common = [i for i, k in enumerate(mirrored_keypoints) if round(k.pt[0], 2) in mirror_x]
        keypoints, descriptors = [keypoints[i] for i in common], descriptors[common]
    points = np.array([k.pt for k in keypoints], np.float16).reshape(-1, 2)
    header = np.array([(len(points), small.shape[1], small.shape[0])], near_duplicates._HEADER)
    mirrored = mirrored if mirrored is not None else np.zeros((0, 32), np.uint8)
    return header.tobytes() + points.tobytes() + descriptors.tobytes() + mirrored.tobytes()


def test_feature_blobs_equal_the_original_glues_on_constructed_images():
    """Overlays to drop keypoints at, a flat frame to trim, and images with no keypoint at all."""
    film = xray(3, 512)
    overlaid = film.copy()
    cv2.putText(overlaid, "R PORTABLE", (40, 80), cv2.FONT_HERSHEY_SIMPLEX, 2.0, 255, 4)
    framed = cv2.copyMakeBorder(film, 60, 60, 90, 90, cv2.BORDER_CONSTANT, value=0)
    for name, gray in {
        "film": film,
        "overlaid": overlaid,
        "framed": framed,
        "blank": np.zeros((300, 300), np.uint8),
        "all white": np.full((300, 200), 255, np.uint8),
    }.items():
        assert near_duplicates.features(gray) == features_with_the_original_glue(gray), name
    assert near_duplicates.unpack(near_duplicates.features(np.zeros((300, 300), np.uint8))).points.shape == (0, 2)


def test_feature_blobs_equal_the_original_glues_on_real_films(shared_data):
    paths = [
        *sorted((shared_data / "covid-chestxray-aug2020-768").rglob("*.*"))[::15],
        *sorted((shared_data / "chest-xray-pneumonia-224").rglob("*.jpeg"))[::200],
    ]
    checked = 0
    for path in paths:
        try:
            gray = preprocess.load_gray(path)
        except preprocess.ImageError:
            continue
        assert near_duplicates.features(gray) == features_with_the_original_glue(gray), path.name
        checked += 1
    assert checked > 60


def strongest_per_image_pair_by_pair(low, high, mirrored, counts, per_image: int) -> dict:
    """_strongest_per_image as first written: a pair is kept while either image has fewer than per_image kept."""
    kept: dict = {}
    taken: dict[int, int] = {}
    for index in np.argsort(-counts, kind="stable"):
        i, j = int(low[index]), int(high[index])
        if taken.get(i, 0) < per_image or taken.get(j, 0) < per_image:
            kept[(i, j, bool(mirrored[index]))] = int(counts[index])
            taken[i], taken[j] = taken.get(i, 0) + 1, taken.get(j, 0) + 1
    return kept


def test_strongest_pairs_per_image_are_the_pair_by_pair_rules_in_its_order():
    """Same pairs, votes and order (confirmed_pairs ranks them with a stable sort, so ties keep this order)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        images = int(rng.integers(2, 40))
        pairs = np.unique(np.sort(rng.integers(0, images, (int(rng.integers(1, 400)), 2)), axis=1), axis=0)
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        low, high = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
        mirrored = rng.integers(0, 2, len(low)).astype(np.int64)
        counts = rng.integers(4, 4 + int(rng.integers(1, 12)), len(low)).astype(np.int64)  # many ties
        for per_image in (0, 1, 3, 5):
            found = near_duplicates._strongest_per_image(low, high, mirrored, counts, per_image)
            expected = strongest_per_image_pair_by_pair(low, high, mirrored, counts, per_image)
            assert list(found.items()) == list(expected.items()), (trial, per_image)
            assert all(type(value) is int for value in found.values())
            assert all(type(i) is int and type(j) is int and type(m) is bool for i, j, m in found)


def _labelled(source: str, name: str, patient: str, label: str) -> Record:
    return Record(image=Path(f"/data/{source}/{name}"), label=label, patient_id=f"{source}:{patient}", source=source)


def test_a_label_conflict_drops_every_copy_by_default_and_is_counted(tmp_path):
    picture, other = write_image(tmp_path / "a.png", seed=1), write_image(tmp_path / "b.png", seed=2)
    records = [
        _labelled("original", "x", "p1", "covid-19"),
        _labelled("copier", "x-copy", "c1", "pneumonia"),  # the same picture, labelled otherwise
        _labelled("original", "y", "p2", "normal"),
    ]
    hashes = {
        str(records[0].image): hashes_of(picture),
        str(records[1].image): hashes_of(picture),
        str(records[2].image): hashes_of(other),
    }
    dropped = dedup.deduplicate(records, hashes, {"original": 1, "copier": 2}, 12)
    assert [r.image.name for r in dropped.kept] == ["y"]
    assert {(d.removed.image.name, d.kept.image.name, d.label_conflict, d.kept_too) for d in dropped.duplicates} == {
        ("x-copy", "x", True, False),
        ("x", "x-copy", True, False),
    }
    assert dropped.summary()["label_conflicts"] == 2 and dropped.summary()["label_conflicts_dropped"] == 2

    kept = dedup.deduplicate(records, hashes, {"original": 1, "copier": 2}, 12, label_conflicts="keep_priority")
    assert sorted(r.image.name for r in kept.kept) == ["x", "y"]
    assert kept.summary()["label_conflicts"] == 1 and kept.summary()["label_conflicts_dropped"] == 0


def test_a_follow_up_in_the_same_pose_is_kept(shared_data):
    """ieee8023 patient 283, days 0 and 7 (metadata.csv): so alike that one similarity fits some inliers; both stay."""
    paths = [shared_data / IEEE_IMAGES / name for name in ("000001-17.jpg", "000002-19-a.jpg")]
    records = [
        Record(image=p, label="pneumonia", patient_id="covid-chestxray:283", source="covid-chestxray") for p in paths
    ]
    grays = {str(p): preprocess.load_gray(p) for p in paths}
    hashes = {
        k: (dedup.pixel_digest(g), dedup.perceptual_hash(preprocess.resize_square(g, 128))) for k, g in grays.items()
    }
    features = {k: near_duplicates.features(g) for k, g in grays.items()}
    result = dedup.deduplicate(records, hashes, {}, 12, features, MIN_INLIERS)
    assert len(result.kept) == 2 and not result.duplicates


# ---------------------------------------------------------------- covidxray audit


def _tree_with_plants(shared_data: Path, root: Path, plant: bool) -> None:
    """A Kaggle-style train/test tree of real radiographs (512 px); `plant` adds a shared patient and a cropped copy."""
    nih = sorted((shared_data / TALO / "No_findings").iterdir())
    grays = [cv2.resize(preprocess.load_gray(p), (512, 512), interpolation=cv2.INTER_AREA) for p in nih[:6]]
    layout = {
        "train/NORMAL/IM-0001-0001.jpeg": grays[0],
        "train/NORMAL/IM-0002-0001.jpeg": grays[1],
        "train/PNEUMONIA/person5_bacteria_1.jpeg": grays[2],
        "test/NORMAL/IM-0003-0001.jpeg": grays[3],
        "test/PNEUMONIA/person5_virus_7.jpeg": grays[4],  # another numbering: not person5_bacteria
    }
    if plant:
        layout["test/PNEUMONIA/person5_bacteria_9.jpeg"] = grays[5]  # the train patient again
        layout["test/NORMAL/IM-0099-0001.jpeg"] = grays[1][60:470, 30:490]  # train's IM-0002, cropped
    for name, gray in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(root / name), gray, [cv2.IMWRITE_JPEG_QUALITY, 85])


def test_audit_finds_a_planted_copy_and_a_planted_shared_patient(shared_data, tmp_path):
    from conftest import run_cli

    _tree_with_plants(shared_data, tmp_path / "clean", plant=False)
    clean = run_cli("audit", str(tmp_path / "clean"), "--workers", "1")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "0 copied image(s) and 0 patient(s) across splits" in " ".join((clean.stdout + clean.stderr).split())

    _tree_with_plants(shared_data, tmp_path / "leaky", plant=True)
    leaky = run_cli("audit", str(tmp_path / "leaky"), "--workers", "1")
    assert leaky.returncode == 1, leaky.stdout + leaky.stderr
    out = " ".join((leaky.stdout + leaky.stderr).split())
    assert "patient zhanglab:person5_bacteria is in test and train" in out
    assert "geometric copy" in out and "IM-0002-0001.jpeg (train)" in out and "IM-0099-0001.jpeg (test)" in out
    assert "1 copied image(s) and 1 patient(s) across splits" in out


def test_audit_of_something_else_says_what_it_expects(tmp_path):
    from conftest import run_cli

    (tmp_path / "only").mkdir()
    result = run_cli("audit", str(tmp_path))
    assert result.returncode == 2 and "one split per top-level folder" in " ".join(
        (result.stdout + result.stderr).split()
    )


@pytest.mark.slow
def test_real_talo_crops_are_all_matched_when_prepared_with_ieee8023(shared_data, tmp_path):
    """The 8 real talo COVID images are re-cropped, rescaled, re-encoded ieee8023 images under the same names."""
    import shutil

    from conftest import run_cli

    data_dir = tmp_path / "both"
    talo = shared_data / "covid19-talo-sample"
    talo_covid = sorted(p.name for p in (shared_data / TALO / "Covid-19").iterdir())
    # ieee8023 as a partial download holding the 8 originals (its other 88 images cost CI time; the benchmark has them)
    ieee = tmp_path / "ieee" / "covid-chestxray-dataset"
    (ieee / "images").mkdir(parents=True)
    shutil.copy2(shared_data / IEEE_IMAGES.parent / "metadata.csv", ieee / "metadata.csv")
    for name in talo_covid:
        shutil.copy2(shared_data / IEEE_IMAGES / name, ieee / "images" / name)
    result = run_cli(
        "prepare",
        "--source",
        f"covid19-talo={talo}",
        "--source",
        f"covid-chestxray={ieee}",
        "--data-dir",
        str(data_dir),
        "--image-size",
        "32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(data_dir / "duplicates.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(Path(r["removed_image"]).name for r in rows) == talo_covid
    assert all(
        Path(r["kept_image"]).name == Path(r["removed_image"]).name and r["kept_source"] == "covid-chestxray"
        for r in rows
    )
    assert all(r["removed_label"] == r["kept_label"] == "covid-19" and r["outcome"] == "removed" for r in rows)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["duplicates_removed"]["total"] == 8 and manifest["patient_disjoint"]

    audit = run_cli("audit", str(data_dir))  # the prepared set, through its decode cache
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "0 copied image(s) and 0 patient(s) across splits" in " ".join((audit.stdout + audit.stderr).split())


def test_prepare_refuses_to_write_a_manifest_that_leaks(tmp_path, monkeypatch):
    """If dedup ever let a copy through, the audit prepare runs on its own split stops it."""
    from covidxray.config import load_config
    from covidxray.data import prepare as prepare_module
    from covidxray.errors import UserError

    source = tmp_path / "given" / "COVID-19-master" / "X-Ray Image DataSet"
    for folder, seeds in (("No_findings", range(0, 12)), ("Pneumonia", range(100, 112))):
        for seed in seeds:
            write_image(source / folder / f"{10000000 + seed:08d}_000.png", seed=seed)
    for seed in range(0, 12):  # a copy of every normal image under another NIH patient
        write_image(source / "No_findings" / f"{20000000 + seed:08d}_000.png", seed=seed)
    real_deduplicate = dedup.deduplicate

    def keeps_every_copy(records, *args, **kwargs):
        result = real_deduplicate(records, *args, **kwargs)
        return dedup.DedupResult(kept=sorted(records, key=lambda r: r.record_id), duplicates=[], matches=result.matches)

    monkeypatch.setattr(prepare_module.dedup, "deduplicate", keeps_every_copy)
    data_dir = tmp_path / "out"
    config = load_config(
        None,
        [
            {
                "data": {
                    "sources": {"covid19-talo": {"from_path": str(tmp_path / "given")}},
                    "data_dir": str(data_dir),
                    "task": "pneumonia",
                    "image_size": 32,
                    "workers": 1,
                    "test_fraction": 0.4,
                    "val_fraction": 0.0,
                }
            }
        ],
    ).data
    with pytest.raises(UserError, match=r"the split leaks .*exact copy"):
        prepare_module.prepare(config, log=lambda line: None)
    assert not (data_dir / "manifest.json").exists()
