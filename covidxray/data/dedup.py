"""Duplicate removal across and within sources, before the patient split.

Public chest X-ray sets copy each other: the Kaggle set is Mendeley's chest
X-rays re-split, the talo COVID images are ieee8023's, and ieee8023 itself
holds the same figure under two patient ids. A copy in train and its twin in
test is leakage, so duplicates go before the split.

* exact: sha256 of the decoded full-resolution gray pixels and their shape.
  It compares what the model would see, not file bytes, so the same picture
  as PNG, BMP, TIFF or a differently compressed PNG counts as one.
* perceptual: a 256-bit DCT hash (pHash with 16x16 low frequencies of a
  64x64 thumbnail) within `max_distance` bits catches JPEG re-encodes and
  rescaled copies. Measured: re-encodes/rescales of real radiographs differ
  by <= 6 bits, different radiographs by >= 76, different phantoms by >= 28.
  Near-duplicates of the *same* patient are follow-ups, never removed.

Which copy stays: the lowest source `priority` (originals before
re-packagings, from the descriptors), then source name, then record id, so
the choice is deterministic. When the removed copy belonged to another
patient id, that id is merged into the kept image's patient (its other
images take the kept patient's id): the two ids evidently name one person,
and merging keeps all their images on one side of the split.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Mapping

import cv2
import numpy as np

from covidxray.sources.base import Record

HASH_VERSION = "sha256-pixels+dct-phash-256/1"
PHASH_INPUT = 64  # thumbnail side the DCT runs on
PHASH_SIDE = 16  # low-frequency block kept: 16x16 = 256 bits
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def pixel_digest(gray: np.ndarray) -> bytes:
    digest = hashlib.sha256(f"{gray.dtype}{gray.shape}".encode())
    digest.update(np.ascontiguousarray(gray).data)
    return digest.digest()


def perceptual_hash(gray: np.ndarray) -> bytes:
    """32-byte DCT hash: bit set where a low frequency exceeds their median (DC excluded from the median)."""
    thumb = cv2.resize(gray, (PHASH_INPUT, PHASH_INPUT), interpolation=cv2.INTER_AREA).astype(np.float32)
    low = cv2.dct(thumb)[:PHASH_SIDE, :PHASH_SIDE].ravel()
    return np.packbits(low > np.median(low[1:])).tobytes()


def hamming(a: bytes, b: bytes) -> int:
    return int(_POPCOUNT[np.frombuffer(a, np.uint8) ^ np.frombuffer(b, np.uint8)].sum())


def _close_within(hashes: np.ndarray, group: np.ndarray, max_distance: int) -> list[tuple[int, int, int]]:
    pairs = []
    rows_per_step = max(1, (1 << 24) // (hashes.shape[1] * len(group)))  # bounds the temporary to ~16 MB
    members = hashes[group]
    for start in range(0, len(group), rows_per_step):
        rows = group[start : start + rows_per_step]
        distance = _POPCOUNT[hashes[rows][:, None, :] ^ members[None, :, :]].sum(axis=2, dtype=np.int32)
        for i, j in zip(*np.nonzero(distance <= max_distance)):
            if rows[i] < group[j]:
                pairs.append((int(rows[i]), int(group[j]), int(distance[i, j])))
    return pairs


def near_pairs(hashes: np.ndarray, max_distance: int) -> list[tuple[int, int, int]]:
    """All (i, j, distance) with i < j and Hamming distance <= max_distance, without comparing all pairs.

    Multi-index hashing: cut the bits into max_distance + 1 blocks; two hashes
    that close must agree exactly on at least one block (pigeonhole), so only
    hashes sharing a block value are compared.
    """
    if len(hashes) < 2 or max_distance < 0:
        return []
    bits = np.unpackbits(hashes, axis=1)
    found: set[tuple[int, int, int]] = set()
    for columns in np.array_split(np.arange(bits.shape[1]), max_distance + 1):
        keys = bits[:, columns].astype(np.int64) @ (np.int64(1) << np.arange(len(columns), dtype=np.int64))
        order = np.argsort(keys, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(keys[order]) != 0, True])
        for begin, end in zip(starts[:-1], starts[1:]):
            if end - begin > 1:
                found.update(_close_within(hashes, np.sort(order[begin:end]), max_distance))
    return sorted(found)


@dataclass(frozen=True)
class Duplicate:
    removed: Record
    kept: Record
    kind: str  # "exact" or "perceptual"
    distance: int


@dataclass
class DedupResult:
    kept: list[Record]
    duplicates: list[Duplicate]
    merged_patients: dict[str, str] = field(default_factory=dict)  # old patient id -> id it joined

    def summary(self) -> dict:
        by_pair: dict[str, Counter] = defaultdict(Counter)
        for dup in self.duplicates:
            by_pair[dup.removed.source][dup.kept.source] += 1
        kinds = Counter(dup.kind for dup in self.duplicates)
        return {
            "total": len(self.duplicates),
            "exact": kinds["exact"],
            "perceptual": kinds["perceptual"],
            # removed from source -> {source of the copy that was kept: count}
            "by_source": {src: dict(sorted(kept.items())) for src, kept in sorted(by_pair.items())},
            "patients_merged": len(self.merged_patients),
        }


class _Patients:
    """Union-find over patient ids; the kept image's patient becomes the group's id."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def root(self, patient: str) -> str:
        while self.parent.get(patient, patient) != patient:
            patient = self.parent[patient]
        return patient

    def merge(self, removed: str, kept: str) -> None:
        removed_root, kept_root = self.root(removed), self.root(kept)
        if removed_root != kept_root:
            self.parent[removed_root] = kept_root


def deduplicate(
    records: list[Record],
    hashes: Mapping[str, tuple[bytes, bytes]],
    priority: Mapping[str, int],
    max_distance: int,
) -> DedupResult:
    """Drop exact and near copies; `hashes` maps str(record.image) -> (pixel digest, perceptual hash)."""
    order = sorted(records, key=lambda r: (priority.get(r.source, 0), r.source, r.record_id, str(r.image)))
    duplicates: list[Duplicate] = []
    first_with: dict[bytes, Record] = {}
    unique: list[Record] = []
    for record in order:
        digest = hashes[str(record.image)][0]
        if digest in first_with:
            duplicates.append(Duplicate(record, first_with[digest], "exact", 0))
        else:
            first_with[digest] = record
            unique.append(record)

    if len(unique) > 1 and max_distance >= 0:
        matrix = np.frombuffer(b"".join(hashes[str(r.image)][1] for r in unique), np.uint8).reshape(len(unique), -1)
        cluster = list(range(len(unique)))  # union-find; the most preferred index is the root

        def find(i: int) -> int:
            while cluster[i] != i:
                cluster[i] = cluster[cluster[i]]
                i = cluster[i]
            return i

        for i, j, _ in near_pairs(matrix, max_distance):
            if unique[i].patient_id != unique[j].patient_id:
                a, b = find(i), find(j)
                cluster[max(a, b)] = min(a, b)
        removed = set()
        for i, record in enumerate(unique):
            root = unique[find(i)]
            if root is not record and record.patient_id != root.patient_id:
                removed.add(i)
                duplicates.append(Duplicate(record, root, "perceptual", hamming(hashes[str(record.image)][1], hashes[str(root.image)][1])))
        unique = [r for i, r in enumerate(unique) if i not in removed]

    rank = {record: i for i, record in enumerate(order)}
    patients = _Patients()
    for dup in sorted(duplicates, key=lambda d: (rank[d.kept], rank[d.removed])):
        if dup.removed.patient_id != dup.kept.patient_id:
            patients.merge(dup.removed.patient_id, dup.kept.patient_id)
    merged = {p: patients.root(p) for p in patients.parent}
    kept = [dataclasses.replace(r, patient_id=merged[r.patient_id]) if r.patient_id in merged else r for r in unique]
    return DedupResult(kept=kept, duplicates=duplicates, merged_patients=merged)
