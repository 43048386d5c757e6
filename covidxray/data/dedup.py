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
  Perceptual matches of the *same* patient may be follow-ups, never removed.
* geometric: crops, borders, rotations, flips, text (near_duplicates.py): ORB
  keypoints vote for candidate pairs, a RANSAC similarity with enough inliers
  confirms them. A confirmed match is a copy, removed even when both images
  carry one patient id (the talo copies carry ieee8023's), except within one
  source and one patient, where it may be a follow-up taken in the same pose.

Copies with different labels are a label conflict: by default every copy is
dropped (`label_conflicts="drop"`), or the preferred copy is kept
("keep_priority"); both are counted and listed.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import cv2
import numpy as np

from covidxray.data import near_duplicates
from covidxray.records import Record

HASH_VERSION = f"sha256-pixels+dct-phash-256/1+{near_duplicates.FEATURE_VERSION}"
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
    kept: Record  # the copy kept in its place; for a dropped label conflict, the copy it conflicts with
    kind: str  # how `removed` was matched: "exact", "perceptual" or "geometric"
    distance: int  # Hamming bits (perceptual), RANSAC inliers (geometric), 0 (exact)
    evidence: str = ""  # the match in words, e.g. "hamming 3" or "164 inliers, spread 0.28, scale 1.12, +0.4 deg"
    label_conflict: bool = False  # the copies carry different harmonised labels
    kept_too: bool = True  # False when a label conflict dropped every copy


@dataclass
class DedupResult:
    kept: list[Record]
    duplicates: list[Duplicate]
    merged_patients: dict[str, str] = field(default_factory=dict)  # old patient id -> id it joined
    # every match found between the input records, (first, second, kind, evidence): what the leak audit checks
    matches: list[tuple[Record, Record, str, str]] = field(default_factory=list)

    def summary(self) -> dict:
        by_pair: dict[str, Counter] = defaultdict(Counter)
        for dup in self.duplicates:
            by_pair[dup.removed.source][dup.kept.source] += 1
        kinds = Counter(dup.kind for dup in self.duplicates)
        conflicts = [dup for dup in self.duplicates if dup.label_conflict]
        return {
            "total": len(self.duplicates),
            "exact": kinds["exact"],
            "perceptual": kinds["perceptual"],
            "geometric": kinds["geometric"],
            # images in a group of copies with different labels, and how many of them were dropped for it
            "label_conflicts": len(conflicts),
            "label_conflicts_dropped": sum(1 for dup in conflicts if not dup.kept_too),
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


LABEL_CONFLICT_POLICIES = ("drop", "keep_priority")


def _other_origin(first: Record, second: Record) -> bool:
    """Two sources, or two patients: a geometric match is then a copy even of one patient's image.

    Within one source and one patient it may be a follow-up taken in the same position
    (measured: a real ieee8023 pair a week apart fits one similarity with 25 inliers), so it
    is treated like a perceptual match there: kept.
    """
    return first.source != second.source or first.patient_id != second.patient_id


class Match(NamedTuple):
    """One match found between two positions of the dedup order."""

    first: int
    second: int
    kind: str  # "exact", "perceptual" or "geometric"
    distance: int  # Hamming bits (perceptual), RANSAC inliers (geometric), 0 (exact)
    evidence: str  # the match in words

    def seen_from(self, position: int) -> Match:
        """This match with `position` first: `second` is then its partner."""
        return self if position == self.first else self._replace(first=self.second, second=self.first)


def matches(
    order: list[Record],
    hashes: Mapping[str, tuple[bytes, bytes]],
    features: Mapping[str, bytes] | None,
    max_distance: int,
    min_inliers: int,
    threads: int = 1,
) -> list[Match]:
    """Matches between positions in `order`, stage by stage (`threads`: for the geometric candidates and checks; the
    matches are the same with any number)."""
    edges: list[Match] = []
    first_with: dict[bytes, int] = {}
    unique: list[int] = []
    for index, record in enumerate(order):
        digest = hashes[str(record.image)][0]
        if digest in first_with:
            edges.append(Match(first_with[digest], index, "exact", 0, "same decoded pixels"))
        else:
            first_with[digest] = index
            unique.append(index)
    if len(unique) < 2 or max_distance < 0:
        return edges

    def other_patients(i: int, j: int) -> bool:  # near copies within one patient are follow-ups: never removed
        return order[unique[i]].patient_id != order[unique[j]].patient_id

    matrix = np.frombuffer(b"".join(hashes[str(order[i].image)][1] for i in unique), np.uint8).reshape(len(unique), -1)
    perceptual = [(i, j, distance) for i, j, distance in near_pairs(matrix, max_distance) if other_patients(i, j)]
    for i, j, distance in perceptual:
        edges.append(Match(unique[i], unique[j], "perceptual", distance, f"hamming {distance} of 256 bits"))
    if features is not None and min_inliers > 0:
        # the geometric check tells a copy from a follow-up itself, so it also runs within a patient;
        # pairs the perceptual hash already joined across patients need no check of their own
        unpacked = [near_duplicates.unpack(features[str(order[i].image)]) for i in unique]
        for i, j, match in near_duplicates.confirmed_pairs(
            unpacked, min_inliers, [(i, j) for i, j, _ in perceptual], threads
        ):
            edges.append(Match(unique[i], unique[j], "geometric", match.inliers, match.describe()))
    return edges


def deduplicate(
    records: list[Record],
    hashes: Mapping[str, tuple[bytes, bytes]],
    priority: Mapping[str, int],
    max_distance: int,
    features: Mapping[str, bytes] | None = None,
    min_inliers: int = 0,
    label_conflicts: str = "drop",
    threads: int = 1,
) -> DedupResult:
    """Drop exact, perceptual and (with `features`) geometric copies.

    `hashes` maps str(record.image) -> (pixel digest, perceptual hash),
    `features` -> near_duplicates.features(); `min_inliers` 0 skips the geometric stage.
    Copies with different labels (`label_conflicts`): "drop" removes every copy, "keep_priority" keeps the preferred one.
    `threads`: geometric checks at once (the result does not depend on it).
    """
    if label_conflicts not in LABEL_CONFLICT_POLICIES:
        raise ValueError(f"label_conflicts={label_conflicts!r}: use one of {LABEL_CONFLICT_POLICIES}")
    # The most preferred copy first: the position order decides which copy of a group stays.
    order = sorted(records, key=lambda r: (priority.get(r.source, 0), r.source, r.record_id, str(r.image)))
    edges = matches(order, hashes, features, max_distance, min_inliers, threads)
    first_match, groups = copy_groups(order, edges)
    duplicates, removed = _duplicates(order, groups, first_match, label_conflicts)
    merged = _merged_patients(order, duplicates)
    kept = [
        dataclasses.replace(r, patient_id=merged.get(r.patient_id, r.patient_id))
        for i, r in enumerate(order)
        if i not in removed
    ]
    found = [(order[m.first], order[m.second], m.kind, m.evidence) for m in edges]
    return DedupResult(kept=kept, duplicates=duplicates, merged_patients=merged, matches=found)


def copy_groups(order: list[Record], edges: list[Match]) -> tuple[dict[int, Match], dict[int, list[int]]]:
    """(each matched position's first match seen from it, each group's root -> the positions that go as its copies).

    A group is every position joined by matches; its root is its most preferred (lowest) position.
    """
    cluster = list(range(len(order)))  # union-find; the most preferred position is the root

    def find(i: int) -> int:
        while cluster[i] != i:
            cluster[i] = cluster[cluster[i]]
            i = cluster[i]
        return i

    first_match: dict[int, Match] = {}
    confirmed = set()  # positions matched exactly or geometrically to a preferred image: copies even within one patient
    for edge in edges:
        i, j = edge.first, edge.second
        a, b = find(i), find(j)
        cluster[max(a, b)] = min(a, b)
        first_match.setdefault(i, edge.seen_from(i))
        first_match.setdefault(j, edge.seen_from(j))
        if edge.kind == "exact" or (edge.kind == "geometric" and _other_origin(order[i], order[j])):
            confirmed.add(max(i, j))
    groups: dict[int, list[int]] = defaultdict(list)
    for i in first_match:
        root = find(i)
        # confirmed copies always go; a perceptual match goes unless it is the root patient's own (maybe a follow-up)
        if i != root and (i in confirmed or order[i].patient_id != order[root].patient_id):
            groups[root].append(i)
    return first_match, groups


def _duplicates(
    order: list[Record], groups: dict[int, list[int]], first_match: dict[int, Match], label_conflicts: str
) -> tuple[list[Duplicate], set[int]]:
    """(a Duplicate per removed copy, the removed positions); a label conflict under "drop" removes the root too."""
    duplicates: list[Duplicate] = []
    removed = {i for copies in groups.values() for i in copies}
    for root, copies in groups.items():
        conflict = len({order[i].label for i in [root, *copies]}) > 1
        drop_all = conflict and label_conflicts == "drop"
        for i in sorted(copies):
            match = first_match[i]
            # the image it matched, unless that went too
            kept_in_its_place = root if match.second in removed else match.second
            duplicates.append(
                _duplicate(order[i], order[kept_in_its_place], match, label_conflict=conflict, kept_too=not drop_all)
            )
        if drop_all:
            twin = min(i for i in copies if order[i].label != order[root].label)
            duplicates.append(
                _duplicate(order[root], order[twin], first_match[twin], label_conflict=True, kept_too=False)
            )
            removed.add(root)
    return duplicates, removed


def _duplicate(removed: Record, kept: Record, match: Match, label_conflict: bool, kept_too: bool) -> Duplicate:
    return Duplicate(
        removed, kept, match.kind, match.distance, match.evidence, label_conflict=label_conflict, kept_too=kept_too
    )


def _merged_patients(order: list[Record], duplicates: list[Duplicate]) -> dict[str, str]:
    """Old patient id -> the id it joins: a removed copy's patient becomes the kept image's (the two ids name one
    person), merged in order of preference so the result does not depend on the order duplicates were found."""
    rank = {record: i for i, record in enumerate(order)}
    patients = _Patients()
    for dup in sorted(duplicates, key=lambda d: (rank[d.kept], rank[d.removed])):
        if dup.removed.patient_id != dup.kept.patient_id:
            patients.merge(dup.removed.patient_id, dup.kept.patient_id)
    return {p: patients.root(p) for p in patients.parent}
