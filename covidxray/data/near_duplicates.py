"""Near duplicates that survive what republishers do: crops, borders, rescaling, re-encoding, text, small rotations, flips.

A global hash compares whole pictures, so a crop that shifts the content
(the talo copies of ieee8023 images lost their borders and R/L markers)
moves every low frequency and escapes it. Local features do not care: the
same patch of the same radiograph gives the same ORB keypoint and binary
descriptor wherever the frame ends. Two stages:

1. Candidates without comparing all pairs. Every image's ORB descriptors
   (of the image and of its mirror image, for flipped copies) are cut into
   32-bit words; images whose descriptors share words collect votes. Each
   word is a bucket of an inverted index, so the work is the sum of the
   bucket sizes squared; buckets holding more than `MAX_BUCKET` entries
   (textures every radiograph has: a stop word) are skipped, which bounds
   the work by entries x MAX_BUCKET: linear in the number of images.
2. Confirmation: the candidate pair's descriptors are matched (Lowe ratio
   test) and a similarity transform (rotation, uniform scale, shift) is
   fitted with RANSAC (cv2.estimateAffinePartial2D). A copy has many inliers
   spread over a large part of the image. A follow-up radiograph of the same
   patient shares anatomy but the ribs, the heart and the tubes moved: only a
   handful of points, or only a burned-in text marker, fit one transform
   (measured on the real samples: different patients <= 17 inliers, a
   follow-up a week apart in the same pose 14, an original and its copy
   >= 32 but for crops near the 20% limit, down to 24; dedup's default
   threshold is 32). Pairs already joined through confirmed copies are not
   checked again: the groups are the same, with fewer checks.

Everything stage 2 needs is computed once per image where it is decoded
(`features`, stored in the decode cache), so confirming never decodes again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import cv2
import numpy as np

FEATURE_VERSION = "orb-384-384-grid8-trim+mirror-eq+clahe-fast10-nowhite-4levels-fastscore-noupsample/7"
SIDE = 384  # longest side the features are computed at (smaller images at their own): copies meet at one size
KEYPOINTS = 384
CANDIDATE_KEYPOINTS = 4 * KEYPOINTS  # detected, before the strongest are spread over a grid
GRID = 8
PATCH = 15  # ORB patch side at SIDE px
UNIFORM_SPREAD = 12  # gray levels within which a border row or column counts as flat
WORDS_PER_DESCRIPTOR = 8  # 32-byte descriptor = 8 words of 32 bits
MAX_BUCKET = 8  # entries sharing one word above which the word is a stop word
MIN_VOTES = 4  # shared words that make a pair a candidate
PER_IMAGE = 3  # candidates per image, best voted first: bounds the geometric checks to 3 per image
RATIO = 0.8  # Lowe's ratio test
REPROJECTION_PX = 4.0  # RANSAC inlier tolerance at SIDE px
MIN_SPREAD = 0.2  # inliers' convex hull / image area, in the image they cover more of
MIN_SCALE, MAX_SCALE = 1 / 8, 8.0
_PAIRS_PER_THREAD = 16  # checked ahead per thread: enough to keep threads busy, few checks wasted on joined pairs
_HEADER = np.dtype([("count", "<u2"), ("width", "<u2"), ("height", "<u2")])


@dataclass(frozen=True)
class Features:
    points: np.ndarray  # (n, 2) float32 keypoint positions at SIDE px
    descriptors: np.ndarray  # (n, 32) uint8 ORB descriptors
    mirrored: np.ndarray  # (n, 32) uint8 descriptors of the same keypoints in the mirror image
    width: int
    height: int

    def mirror_points(self) -> np.ndarray:
        return np.column_stack([self.width - 1 - self.points[:, 0], self.points[:, 1]])


@dataclass(frozen=True)
class Match:
    inliers: int
    spread: float  # the larger of the two inlier hull / image area fractions
    scale: float  # size of the second image relative to the first (at SIDE px)
    degrees: float
    flipped: bool

    def describe(self) -> str:
        return f"{self.inliers} inliers, spread {self.spread:.2f}, scale {self.scale:.2f}, {self.degrees:+.1f} deg" + (
            ", mirrored" if self.flipped else ""
        )


def _orb(count: int) -> cv2.ORB:
    # A small patch and edge margin keep keypoints near the crop border. The FAST threshold: 10 still finds
    # CANDIDATE_KEYPOINTS corners in the equalised radiographs, and half as many weak ones as 5 (detection -40%).
    # 4 pyramid levels (2.1x scale range; copies at other scales meet at SIDE px anyway) ranked by FAST score instead
    # of 6 levels ranked by Harris: ~17% less time per image, and on bench_dedup's suite no copy lost (issue 26).
    return cv2.ORB_create(
        nfeatures=count,
        scaleFactor=1.2,
        nlevels=4,
        edgeThreshold=PATCH,
        patchSize=PATCH,
        fastThreshold=10,
        scoreType=cv2.ORB_FAST_SCORE,
    )


def _spread_out(keypoints, width: int, height: int) -> list:
    """The KEYPOINTS strongest, at most a fair share per cell of a GRID x GRID grid first.

    Burned-in text, markers and borders have the strongest corners of all; taken
    by strength alone they would crowd out the anatomy a copy shares.
    """
    if not keypoints:
        return []
    points = cv2.KeyPoint_convert(keypoints)
    strength = np.array([k.response for k in keypoints], np.float32)
    cell = np.minimum(GRID - 1, (points[:, 1] * GRID / height).astype(int)) * GRID + np.minimum(
        GRID - 1, (points[:, 0] * GRID / width).astype(int)
    )
    by_cell = np.lexsort(
        (np.arange(len(keypoints)), -strength, cell)
    )  # strongest first within each cell, ties by detection order
    first_of_cell = np.searchsorted(cell[by_cell], cell[by_cell])
    rank_in_cell = np.empty(len(keypoints), int)
    rank_in_cell[by_cell] = np.arange(len(keypoints)) - first_of_cell
    fair_share = rank_in_cell < -(-KEYPOINTS // (GRID * GRID))
    order = np.lexsort(
        (np.arange(len(keypoints)), -strength, ~fair_share)
    )  # the fair shares by strength, then the rest by strength
    return [keypoints[i] for i in order[:KEYPOINTS].tolist()]


def _at_side(gray: np.ndarray) -> np.ndarray:
    """`gray` with its longer side SIDE, or as it is when smaller: upsampling adds no detail, only corners of the
    interpolation (a 224 px image cost ~40% more at 384 px; the ORB pyramid and the fitted scale bridge the gap)."""
    height, width = gray.shape
    if max(height, width) <= SIDE:
        return gray
    scale = SIDE / max(height, width)
    if scale <= 0.5:  # averaging by a whole factor first: INTER_AREA is several times faster at an integer ratio
        step = int(1 / scale)
        gray = cv2.resize(gray, None, fx=1 / step, fy=1 / step, interpolation=cv2.INTER_AREA)
        height, width = gray.shape
        scale = SIDE / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return cv2.resize(gray, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)


def trim_uniform_border(gray: np.ndarray) -> np.ndarray:
    """`gray` without the flat frame around it (padding a copy added, or the black margin of a scan).

    Cut away, both in the original and in a padded copy, the content is at the
    same scale at SIDE px, so the same keypoints are found. Rows and columns
    whose gray levels span at most UNIFORM_SPREAD (at SIDE px, where JPEG noise
    is averaged away) count as frame; nothing is trimmed below half the side.
    """
    small = _at_side(gray)
    rows = np.flatnonzero(np.ptp(small, axis=1) > UNIFORM_SPREAD)
    columns = np.flatnonzero(np.ptp(small, axis=0) > UNIFORM_SPREAD)
    if len(rows) < small.shape[0] / 2 or len(columns) < small.shape[1] / 2:
        return small
    top, bottom, left, right = rows[0], rows[-1] + 1, columns[0], columns[-1] + 1
    if (top, bottom, left, right) == (0, small.shape[0], 0, small.shape[1]):
        return small
    fy, fx = gray.shape[0] / small.shape[0], gray.shape[1] / small.shape[1]
    return _at_side(gray[int(top * fy) : int(np.ceil(bottom * fy)), int(left * fx) : int(np.ceil(right * fx))])


def _off_overlays(keypoints, gray: np.ndarray) -> list:
    """The keypoints whose patch holds no full-white pixel.

    Burned-in text and markers are drawn at full white, and a brightness or
    contrast increase clips to it: a keypoint touching such pixels describes
    the overlay or a clipped edge, not the picture the copies share (measured:
    text copies matched 97% -> 99%+). Most radiographs hold few such pixels.
    """
    if not keypoints:
        return []
    usable = cv2.erode((gray < 255).astype(np.uint8), np.ones((PATCH, PATCH), np.uint8))
    x, y = cv2.KeyPoint_convert(keypoints).astype(int).T
    return list(itertools.compress(keypoints, usable[y, x].tolist()))  # 3x faster than zip over numpy booleans


def features(gray: np.ndarray) -> bytes:
    """Compact ORB keypoints + descriptors of an 8-bit gray image (and of its mirror image), ~26 KB."""
    trimmed = trim_uniform_border(gray)
    # brightness, contrast and gamma changes are monotonic: equalising undoes them; CLAHE then lifts the soft
    # lung texture a clipped copy keeps to the contrast of bones and markers (intensity copies matched 98% -> 99%+)
    small = cv2.createCLAHE(clipLimit=2.0, tileGridSize=(8, 8)).apply(cv2.equalizeHist(trimmed))
    orb = _orb(CANDIDATE_KEYPOINTS)
    keypoints = _spread_out(_off_overlays(orb.detect(small, None), trimmed), small.shape[1], small.shape[0])
    keypoints, descriptors = orb.compute(small, keypoints)
    if descriptors is None:
        keypoints, descriptors = [], np.zeros((0, 32), np.uint8)
    mirror_width = small.shape[1]
    # The mirror image has the mirrored keypoints (FAST and its score are symmetric); only descriptors need computing.
    mirrored_keypoints = [
        cv2.KeyPoint(mirror_width - 1 - k.pt[0], k.pt[1], k.size, (180 - k.angle) % 360, k.response, k.octave)
        for k in keypoints
    ]
    kept, mirrored = orb.compute(cv2.flip(small, 1), mirrored_keypoints)
    if len(kept) != len(keypoints):  # compute() drops keypoints too close to the border: keep the common ones
        mirror_x = {round(k.pt[0], 2) for k in kept}
        common = [i for i, k in enumerate(mirrored_keypoints) if round(k.pt[0], 2) in mirror_x]
        keypoints, descriptors = [keypoints[i] for i in common], descriptors[common]
    # k.pt is the float32 position as an exact float64: rounding the float32 array to float16 gives the same values
    points = np.asarray(cv2.KeyPoint_convert(keypoints), np.float16).reshape(-1, 2)
    header = np.array([(len(points), small.shape[1], small.shape[0])], _HEADER)
    mirrored = mirrored if mirrored is not None else np.zeros((0, 32), np.uint8)
    return header.tobytes() + points.tobytes() + descriptors.tobytes() + mirrored.tobytes()


def unpack(blob: bytes) -> Features:
    header = np.frombuffer(blob, _HEADER, count=1)[0]
    n = int(header["count"])
    offset = _HEADER.itemsize
    points = np.frombuffer(blob, np.float16, count=2 * n, offset=offset).reshape(n, 2).astype(np.float32)
    offset += 4 * n
    descriptors = np.frombuffer(blob, np.uint8, count=32 * n, offset=offset).reshape(n, 32)
    mirrored = np.frombuffer(blob, np.uint8, count=32 * n, offset=offset + 32 * n).reshape(n, 32)
    return Features(points, descriptors, mirrored, int(header["width"]), int(header["height"]))


def candidate_pairs(
    all_features: list[Features], min_votes: int = MIN_VOTES, per_image: int = PER_IMAGE, threads: int = 1
) -> dict[tuple[int, int, bool], int]:
    """(i, j, mirrored) with i < j -> shared descriptor words, for pairs with at least `min_votes`.

    `mirrored` pairs share words between one image and the other's mirror image.
    Work and memory are linear in the number of descriptors (see module doc).
    `threads` > 1 takes that many word columns at once (numpy's sorts and element-wise loops release the GIL) with
    the same result: every column's pairs are counted together after all columns are done.
    """
    entries, words = [], []
    for index, item in enumerate(all_features):
        for flipped, descriptors in ((0, item.descriptors), (1, item.mirrored)):
            if len(descriptors):
                words.append(np.ascontiguousarray(descriptors).view("<u4"))
                entries.append(np.full(len(descriptors), 2 * index + flipped, np.uint64))
    if not words:
        return {}
    word_table, entry_of = np.concatenate(words), np.concatenate(entries)
    count = len(all_features)

    def shared_in(column: int) -> list[np.ndarray]:
        """One pair id per word of this column two images share."""
        # word and entry packed in one integer: a plain sort (several times faster than argsort) groups the buckets
        packed = np.sort((word_table[:, column].astype(np.uint64) << np.uint64(32)) | entry_of)
        keys, entry = packed >> np.uint64(32), (packed & np.uint64(0xFFFFFFFF)).astype(np.int64)
        image, side = entry >> 1, entry & 1
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        sizes = np.diff(np.r_[starts, len(keys)])
        usable = np.repeat(sizes <= MAX_BUCKET, sizes)  # stop words out
        met = []
        for gap in range(1, MAX_BUCKET):
            same = (keys[gap:] == keys[:-gap]) & usable[gap:] & usable[:-gap]
            if not same.any():
                break
            a, b = image[:-gap][same], image[gap:][same]
            mirrored = side[:-gap][same] ^ side[gap:][same]
            other = a != b
            low, high = np.minimum(a, b)[other], np.maximum(a, b)[other]
            met.append((low * count + high) * 2 + mirrored[other])
        return met

    columns = range(WORDS_PER_DESCRIPTOR)
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            per_column = list(pool.map(shared_in, columns))
    else:  # one column after the other, in this thread
        per_column = [shared_in(column) for column in columns]
    met = [ids for column in per_column for ids in column]
    if not met:
        return {}
    # a copy shares many words, often several per descriptor: every shared word is one vote
    pair_ids, counts = np.unique(np.concatenate(met), return_counts=True)
    keep = counts >= min_votes
    pair_ids, counts = pair_ids[keep], counts[keep]
    low, high, mirrored = pair_ids // 2 // count, pair_ids // 2 % count, pair_ids % 2
    return _strongest_per_image(low, high, mirrored, counts, per_image)


def _strongest_per_image(low, high, mirrored, counts, per_image: int) -> dict[tuple[int, int, bool], int]:
    """Keep a pair when it is among the `per_image` best-voted pairs of either image: at most per_image x n pairs.

    Taken best voted first (ties in pair order), an image's first `per_image` pairs are always kept, and after them
    it holds `per_image` kept pairs already: so a pair is kept exactly when it is among the first `per_image` pairs
    of one of its images, which numpy counts for all pairs at once (in prepare's serial tail: 48 ms in a Python loop
    over the 99,000 voted pairs of 606 ieee8023 films, 20 ms so).
    """
    order = np.argsort(-counts, kind="stable")
    # both images of each pair, pair by pair in vote order: a stable sort by image keeps each image's pairs in it
    images = np.column_stack([low[order], high[order]]).ravel()
    by_image = np.argsort(images, kind="stable")
    rank = np.empty(len(images), np.int64)
    rank[by_image] = np.arange(len(images)) - np.searchsorted(images[by_image], images[by_image])
    kept = order[(rank < per_image).reshape(-1, 2).any(axis=1)]
    pairs = zip(low[kept].tolist(), high[kept].tolist(), mirrored[kept].astype(bool).tolist())
    return dict(zip(pairs, counts[kept].tolist()))


def _hull_fraction(points: np.ndarray, width: int, height: int) -> float:
    if len(points) < 3:
        return 0.0
    return float(cv2.contourArea(cv2.convexHull(points.astype(np.float32)))) / float(width * height)


def verify(first: Features, second: Features, mirrored: bool, min_inliers: int) -> Match | None:
    """The similarity transform mapping `first` onto `second` (or its mirror image), if a copy's worth of points fit it."""
    other_descriptors = second.mirrored if mirrored else second.descriptors
    if len(first.descriptors) < 2 or len(other_descriptors) < 2:
        return None
    other_points = second.mirror_points() if mirrored else second.points
    # the two nearest descriptors as arrays (knnMatch would build a Python object per match)
    distance, nearest = cv2.batchDistance(
        first.descriptors, other_descriptors, cv2.CV_32S, normType=cv2.NORM_HAMMING, K=2
    )
    good = np.flatnonzero(distance[:, 0] < RATIO * distance[:, 1])
    if len(good) < max(3, min_inliers):
        return None
    source = first.points[good]
    target = other_points[nearest[good, 0]]
    transform, inlier_mask = cv2.estimateAffinePartial2D(
        source, target, method=cv2.RANSAC, ransacReprojThreshold=REPROJECTION_PX, maxIters=2000, confidence=0.995
    )
    if transform is None:
        return None
    inlier = inlier_mask.ravel().astype(bool)
    scale = float(np.hypot(transform[0, 0], transform[1, 0]))
    # a crop covers all of the copy and part of the original, a padded copy the other way round: the larger fraction
    spread = max(
        _hull_fraction(source[inlier], first.width, first.height),
        _hull_fraction(target[inlier], second.width, second.height),
    )
    match = Match(
        int(inlier.sum()), spread, scale, float(np.degrees(np.arctan2(transform[1, 0], transform[0, 0]))), mirrored
    )
    if match.inliers < min_inliers or match.spread < MIN_SPREAD or not MIN_SCALE <= scale <= MAX_SCALE:
        return None
    return match


def confirmed_pairs(
    all_features: list[Features], min_inliers: int, joined: Iterable[tuple[int, int]] = (), threads: int = 1
) -> list[tuple[int, int, Match]]:
    """(i, j, Match) for the candidate pairs the geometric check confirms, unless already joined.

    `joined`: pairs known to be copies by other means (the perceptual hash); a pair
    joined through them or through confirmed pairs is not checked.
    `threads` > 1 finds the candidates in that many threads (`candidate_pairs`) and checks that many pairs at once
    (OpenCV releases the GIL) with the same result: the pairs of a window are checked ahead, in vote order, and a
    check whose pair a better-voted pair of the window joined meanwhile is discarded, as the serial order would not
    have made it.
    """
    found = []
    group = list(range(len(all_features)))  # union-find over the copies known so far

    def root(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    def check(pair: tuple[int, int, bool]) -> Match | None:
        i, j, mirrored = pair
        return verify(all_features[i], all_features[j], mirrored, min_inliers)

    def join(i: int, j: int) -> None:
        group[max(root(i), root(j))] = min(root(i), root(j))

    for i, j in joined:
        join(i, j)
    # a pair already joined through other confirmed copies needs no check of its own: the best voted go first
    candidates = candidate_pairs(all_features, threads=threads)
    ranked = [pair for pair, _ in sorted(candidates.items(), key=lambda item: -item[1])]
    if threads <= 1:
        for i, j, mirrored in ranked:
            if root(i) != root(j) and (match := check((i, j, mirrored))):
                found.append((i, j, match))
                join(i, j)
        return found
    window = threads * _PAIRS_PER_THREAD
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(ranked), window):
            pending = [(i, j, mirrored) for i, j, mirrored in ranked[start : start + window] if root(i) != root(j)]
            for (i, j, _), match in zip(pending, pool.map(check, pending)):
                if match and root(i) != root(j):
                    found.append((i, j, match))
                    join(i, j)
    return found
