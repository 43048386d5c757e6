"""Near-duplicate detection on real radiographs: recall per transform, false merges, and cost against decoding.

Needs the real samples in ../shared/data (see its README.md).

1. Transform suite. Every decodable real radiograph of the samples (NIH PNGs
   from covid19-talo, ieee8023 images, Kaggle full-resolution originals) gets
   one copy per transform family, with parameters drawn from a seeded RNG over
   the whole range the issue names: crop 0-20% per side, border 5-25% per
   side, rescale 0.25-4x, JPEG quality 40-90, brightness/contrast/gamma,
   burned-in text and markers, rotation up to +-5 deg, horizontal flip. All
   originals and copies go through `dedup.matches` together (the same matching
   `prepare` runs), each copy under its own patient id. Recall per family: the
   share of copies in one match component with their original.
2. False merges. The real images of different patients (the 5856 Kaggle
   images, the NIH and ieee8023 images; the talo COVID crops are left out as
   they are copies) through `dedup.matches`: every match between two different
   patient ids is listed. A match of two pixel-identical pictures (after the
   fitted transform, mean absolute difference below 2 gray levels) is a
   duplicate the source itself carries, not a false merge. Real follow-up
   pairs (NIH and ieee8023 images sharing a patient id) are counted too: the
   geometric check must confirm none.
3. Cost. N = 1k, 5k, 20k JPEG files, 1024 px on the long side, made from the
   Kaggle images with a random transform each (so most have a twin). Per file
   in one process: decode (`preprocess.load_gray`, `resize_square` to 128 px,
   PNG encode, pixel sha256 and pHash: what prepare's decode step does
   besides the features) and, separately timed, the dedup features
   (`near_duplicates.features`); then the matching (`dedup.matches`) for the
   first N files in a fresh process (its peak RSS is the memory). Goal:
   features + matching <= 2x decode.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from collections import defaultdict
from pathlib import Path

import _bench

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): dedup itself, and the decode it is weighed against.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/data/dedup.py",
    "covidxray/data/near_duplicates.py",
    "covidxray/edge/preprocess.py",
)


SHARED = _bench.REPO.parent / "shared" / "data"
FAMILIES = ("crop", "border", "rescale", "jpeg", "intensity", "text", "rotate", "flip")


def transform(gray, family: str, rng):
    """A copy of `gray` as a republisher might make it, parameters drawn over the issue's full range."""
    import cv2
    import numpy as np

    h, w = gray.shape
    if family == "crop":
        top, bottom, left, right = rng.uniform(0, 0.2, 4)
        return gray[int(top * h) : h - int(bottom * h), int(left * w) : w - int(right * w)]
    if family == "border":
        top, bottom, left, right = (int(f * s) for f, s in zip(rng.uniform(0.05, 0.25, 4), (h, h, w, w)))
        return cv2.copyMakeBorder(
            gray, top, bottom, left, right, cv2.BORDER_CONSTANT, value=int(rng.choice([0, 128, 255]))
        )
    if family == "rescale":
        factor = float(np.exp(rng.uniform(np.log(0.25), np.log(4.0))))
        size = (max(8, round(w * factor)), max(8, round(h * factor)))
        return cv2.resize(gray, size, interpolation=cv2.INTER_AREA if factor < 1 else cv2.INTER_CUBIC)
    if family == "jpeg":
        return cv2.imdecode(
            cv2.imencode(".jpg", gray, [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(40, 91))])[1], cv2.IMREAD_GRAYSCALE
        )
    if family == "intensity":
        gamma, contrast, brightness = rng.uniform(0.6, 1.6), rng.uniform(0.7, 1.3), rng.uniform(-30, 30)
        lut = np.clip(255 * (np.arange(256) / 255) ** gamma * contrast + brightness, 0, 255).astype(np.uint8)
        return lut[gray]
    if family == "text":
        out = gray.copy()
        scale = max(h, w) / 512
        for _ in range(int(rng.integers(2, 5))):
            text = str(rng.choice(["R", "L", "PORTABLE", "AP SUPINE", "2020-03-14", "ERECT", "Fig. 2"]))
            x, y = int(rng.uniform(0, 0.7) * w), int(rng.uniform(0.1, 1.0) * h)
            cv2.putText(
                out, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, scale * rng.uniform(0.8, 2.0), 255, max(1, int(2 * scale))
            )
        x, y, side = int(rng.uniform(0, 0.8) * w), int(rng.uniform(0, 0.8) * h), int(0.08 * min(h, w))
        cv2.rectangle(out, (x, y), (x + side, y + side), 255, -1)  # a lead marker
        return out
    if family == "rotate":
        angle = rng.uniform(-5, 5)
        matrix = cv2.getRotationMatrix2D((w / 2, h / 2), angle, 1.0)
        return cv2.warpAffine(
            gray, matrix, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0
        )
    if family == "flip":
        return cv2.flip(gray, 1)
    raise ValueError(family)


def real_images() -> list[tuple[Path, str]]:
    """(path, patient) of every real radiograph sample of a known patient, talo COVID copies excluded."""
    import csv

    from covidxray.sources import zhanglab

    found = []
    talo = SHARED / "covid19-talo-sample" / "X-Ray Image DataSet"
    for folder in ("No_findings", "Pneumonia"):
        found += [(p, f"nih:{p.name[:8]}") for p in sorted((talo / folder).iterdir())]
    ieee = SHARED / "covid-chestxray-sample" / "covid-chestxray-dataset"
    with open(ieee / "metadata.csv", newline="") as handle:
        patient_of = {row["filename"]: row["patientid"] for row in csv.DictReader(handle)}
    found += [(p, f"ieee:{patient_of[p.name]}") for p in sorted((ieee / "images").iterdir()) if p.name in patient_of]
    for root in (
        SHARED / "chest-xray-pneumonia-originals" / "chest_xray",
        SHARED / "chest-xray-pneumonia-224" / "chest_xray",
    ):
        found += [(p, f"kaggle:{zhanglab.parse_name(p.stem)[0]}") for p in sorted(root.glob("*/*/*.jpeg"))]
    return found


def decoded(paths_and_patients, limit: int | None = None):
    """(path, patient, gray) of the files that decode as radiographs."""
    from covidxray.edge import preprocess

    out = []
    for path, patient in paths_and_patients:
        try:
            out.append((path, patient, preprocess.load_gray(path)))
        except preprocess.ImageError:
            continue
        if limit and len(out) >= limit:
            break
    return out


def signatures(images: list) -> tuple[dict, dict]:
    from covidxray.data import dedup, near_duplicates
    from covidxray.edge import preprocess

    hashes, features = {}, {}
    for key, gray in images:
        hashes[key] = (dedup.pixel_digest(gray), dedup.perceptual_hash(preprocess.resize_square(gray, 128)))
        features[key] = near_duplicates.features(gray)
    return hashes, features


def match_records(
    keys_and_patients: list[tuple[str, str]], hashes, features, config
) -> list[tuple[str, str, str, str]]:
    from covidxray.data import dedup
    from covidxray.records import Record

    records = [
        Record(image=Path(key), label="x", patient_id=patient, source="bench") for key, patient in keys_and_patients
    ]
    edges = dedup.matches(records, hashes, features, config.dedup_max_distance, config.dedup_min_inliers)
    return [(str(records[i].image), str(records[j].image), kind, evidence) for i, j, kind, _, evidence in edges]


def components(edges) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for a, b, *_ in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent}


def transform_suite(originals, config, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    images, owners = [], []
    for index, (_path, _patient, gray) in enumerate(originals):
        images.append((f"orig/{index}", gray))
        owners.append((f"orig/{index}", f"orig-patient/{index}"))
        for family in FAMILIES:
            images.append((f"{family}/{index}", transform(gray, family, rng)))
            owners.append((f"{family}/{index}", f"copy-patient/{family}/{index}"))
    hashes, features = signatures(images)
    started = time.perf_counter()
    edges = match_records(owners, hashes, features, config)
    seconds = time.perf_counter() - started
    component = components(edges)
    recall, kinds = {}, defaultdict(lambda: defaultdict(int))
    for family in FAMILIES:
        hits = [
            component.get(f"{family}/{i}", f"{family}/{i}") == component.get(f"orig/{i}", f"orig/{i}")
            for i in range(len(originals))
        ]
        recall[family] = sum(hits) / len(hits)
    for a, b, kind, _ in edges:
        for key in (a, b):
            kinds[key.split("/")[0]][kind] += 1
    wrong = [(a, b, kind, ev) for a, b, kind, ev in edges if a.split("/")[1] != b.split("/")[1]]
    return {
        "originals": len(originals),
        "recall": recall,
        "wrong_matches": wrong,
        "match_seconds": seconds,
        "kinds": {k: dict(v) for k, v in kinds.items()},
    }


def pixel_identical(a, b) -> float:
    """Mean absolute gray difference after aligning `b` onto `a` with ORB + RANSAC at 384 px (inf when no fit)."""
    import cv2
    import numpy as np

    from covidxray.data import near_duplicates

    fa, fb = near_duplicates.unpack(near_duplicates.features(a)), near_duplicates.unpack(near_duplicates.features(b))
    for mirrored in (False, True):
        match = near_duplicates.verify(fa, fb, mirrored, 10)
        if match is None:
            continue
        small = [
            cv2.equalizeHist(cv2.resize(g, (f.width, f.height), interpolation=cv2.INTER_AREA))
            for g, f in ((a, fa), (b, fb))
        ]
        other = cv2.flip(small[1], 1) if mirrored else small[1]
        points = fb.mirror_points() if mirrored else fb.points
        bf = cv2.BFMatcher(cv2.NORM_HAMMING).knnMatch(fb.mirrored if mirrored else fb.descriptors, fa.descriptors, k=2)
        good = [m[0] for m in bf if len(m) == 2 and m[0].distance < 0.8 * m[1].distance]
        matrix, _ = cv2.estimateAffinePartial2D(
            points[[m.queryIdx for m in good]], fa.points[[m.trainIdx for m in good]], method=cv2.RANSAC
        )
        warped = cv2.warpAffine(other, matrix, (fa.width, fa.height), borderValue=-1)
        mask = cv2.warpAffine(np.ones_like(other), matrix, (fa.width, fa.height)) > 0
        return float(np.abs(small[0][mask].astype(int) - warped[mask].astype(int)).mean())
    return float("inf")


def false_merges(reals, config) -> dict:
    images = [(str(path), gray) for path, _, gray in reals]
    hashes, features = signatures(images)
    patient_of = {str(path): patient for path, patient, _ in reals}
    edges = match_records([(str(path), patient) for path, patient, _ in reals], hashes, features, config)
    gray_of = {str(path): gray for path, _, gray in reals}
    different, followups = [], []
    for a, b, kind, evidence in edges:
        if patient_of[a] != patient_of[b]:
            different.append(
                {
                    "a": a,
                    "b": b,
                    "kind": kind,
                    "evidence": evidence,
                    "mean_abs_diff": round(pixel_identical(gray_of[a], gray_of[b]), 2),
                }
            )
        elif kind == "geometric":
            followups.append(
                {
                    "a": a,
                    "b": b,
                    "evidence": evidence,
                    "mean_abs_diff": round(pixel_identical(gray_of[a], gray_of[b]), 2),
                }
            )
    by_patient = defaultdict(list)
    for path, patient, _ in reals:
        by_patient[patient].append(str(path))
    followup_pairs = sum(len(v) * (len(v) - 1) // 2 for v in by_patient.values())
    patients = list(by_patient)
    return {
        "images": len(reals),
        "patients": len(patients),
        "different_patient_pairs": len(reals) * (len(reals) - 1) // 2 - followup_pairs,
        "same_patient_pairs": followup_pairs,
        "different_patient_matches": different,
        "same_patient_geometric_matches": followups,
    }


def scaling_files(folder: Path, count: int, px: int, seed: int) -> list[Path]:
    """`count` JPEG files, long side `px`, each a random transform of a Kaggle image (reused between runs)."""
    import cv2
    import numpy as np

    from covidxray.edge import preprocess

    folder.mkdir(parents=True, exist_ok=True)
    bases = sorted((SHARED / "chest-xray-pneumonia-224" / "chest_xray").glob("*/*/*.jpeg"))
    rng = np.random.default_rng(seed)
    files = []
    for index in range(count):
        path = folder / f"{index:06d}.jpg"
        family = FAMILIES[int(rng.integers(len(FAMILIES)))]
        base = bases[index % len(bases)]
        state = rng.integers(1 << 31)
        if not path.exists():
            gray = transform(preprocess.load_gray(base), family, np.random.default_rng(state))
            scale = px / max(gray.shape)
            gray = cv2.resize(
                gray, (round(gray.shape[1] * scale), round(gray.shape[0] * scale)), interpolation=cv2.INTER_CUBIC
            )
            tmp = path.with_suffix(".partial.jpg")
            cv2.imwrite(str(tmp), gray, [cv2.IMWRITE_JPEG_QUALITY, 85])
            os.replace(tmp, path)
        files.append(path)
    return files


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would report the forking parent's peak after exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _matching_child(pickled: Path, count: int, max_distance: int, min_inliers: int) -> None:
    """Run in a fresh process: time dedup.matches over the first `count` signatures; print JSON with peak RSS."""
    from covidxray.config import DataConfig

    with open(pickled, "rb") as handle:
        keys, hashes, features = pickle.load(handle)
    keys = keys[:count]
    baseline = _peak_rss_mb()
    started, cpu = time.perf_counter(), time.process_time()
    edges = match_records(
        [(k, k) for k in keys],
        {k: hashes[k] for k in keys},
        {k: features[k] for k in keys},
        DataConfig(dedup_max_distance=max_distance, dedup_min_inliers=min_inliers),
    )
    print(
        json.dumps(
            {
                "seconds": time.perf_counter() - started,
                "cpu_seconds": time.process_time() - cpu,
                "peak_rss_mb": _peak_rss_mb(),
                "rss_before_mb": baseline,
                "matches": len(edges),
            }
        )
    )


def scaling(args, config) -> list[dict]:
    from covidxray.data import dedup, near_duplicates
    from covidxray.edge import preprocess

    files = scaling_files(args.workdir / f"variants-{args.scale_px}px", max(args.sizes), args.scale_px, args.seed)
    decode_s, feature_s, keys, hashes, features = [], [], [], {}, {}
    for path in files:
        started = time.process_time()
        gray = preprocess.load_gray(
            path
        )  # what prepare's decode step does besides the features (image_cache.decode_one)
        small = preprocess.resize_square(gray, 128)
        preprocess.encode_png(small)
        hashes[str(path)] = (dedup.pixel_digest(gray), dedup.perceptual_hash(small))
        middle = time.process_time()
        blob = near_duplicates.features(gray)
        done = time.process_time()
        features[str(path)] = blob
        keys.append(str(path))
        decode_s.append(middle - started)
        feature_s.append(done - middle)
    pickled = args.workdir / "signatures.pickle"
    with open(pickled, "wb") as handle:
        pickle.dump((keys, hashes, features), handle)
    rows = []
    for count in args.sizes:
        child = _bench.run(
            [
                sys.executable,
                __file__,
                "--matching-child",
                str(pickled),
                str(count),
                str(config.dedup_max_distance),
                str(config.dedup_min_inliers),
            ]
        )
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        decode, feats = sum(decode_s[:count]), sum(feature_s[:count])
        rows.append(
            {
                "images": count,
                "decode_cpu_s": decode,
                "features_cpu_s": feats,
                "matching_cpu_s": measured["cpu_seconds"],
                "matching_wall_s": measured["seconds"],
                "peak_rss_mb": measured["peak_rss_mb"],
                "rss_before_mb": measured["rss_before_mb"],
                "matches": measured["matches"],
                "dedup_over_decode": (feats + measured["cpu_seconds"]) / decode,
            }
        )
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--matching-child"]:
        _matching_child(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    from covidxray.config import DataConfig

    bench = _bench.Bench("dedup", __doc__)
    bench.parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1000, 5000, 20000],
        help="images for the cost table (default: %(default)s)",
    )
    bench.parser.add_argument(
        "--scale-px", type=int, default=1024, help="long side of the cost table's files (default: %(default)s)"
    )
    bench.parser.add_argument("--originals", type=int, default=0, help="limit the transform suite's originals (0: all)")
    bench.parser.add_argument("--reals", type=int, default=0, help="limit the false-merge set (0: all)")
    bench.parser.add_argument("--seed", type=int, default=0)
    args = bench.parse({"sizes": [30, 60], "scale_px": 256, "originals": 6, "reals": 40})
    if not SHARED.is_dir():
        sys.exit(f"{SHARED} not found: this benchmark needs the real samples")
    config = DataConfig()
    reals = decoded(real_images(), args.reals or None)
    # originals for the transform suite: the full-resolution ones (the 224 px Kaggle copies are not originals)
    originals = [item for item in reals if "chest-xray-pneumonia-224" not in str(item[0])][: args.originals or None]

    suite = transform_suite(originals, config, args.seed)
    bench.table(
        f"recall per transform family, {suite['originals']} real originals, one copy each",
        ["family", "recall", "matched by (copies' edges)"],
        [
            [
                f,
                f"{suite['recall'][f]:.3f}",
                ", ".join(f"{k} {n}" for k, n in sorted(suite["kinds"].get(f, {}).items())),
            ]
            for f in FAMILIES
        ],
    )
    for family in FAMILIES:
        bench.at_least(f"recall, {family}", suite["recall"][family], 0.99)
    bench.at_most(
        "matches between an original and another original's copy (transform suite)", len(suite["wrong_matches"]), 0
    )

    merges = false_merges(reals, config)
    identical = [m for m in merges["different_patient_matches"] if m["mean_abs_diff"] < 2]
    false = [m for m in merges["different_patient_matches"] if m["mean_abs_diff"] >= 2]
    bench.table(
        "matches between different patients' real images",
        [
            "images",
            "patients",
            "different-patient pairs",
            "matched",
            "of them pixel-identical",
            "false merges",
            "follow-up pairs (same patient)",
            "follow-ups confirmed geometrically",
        ],
        [
            [
                merges["images"],
                merges["patients"],
                merges["different_patient_pairs"],
                len(merges["different_patient_matches"]),
                len(identical),
                len(false),
                merges["same_patient_pairs"],
                len(merges["same_patient_geometric_matches"]),
            ]
        ],
    )
    if merges["different_patient_matches"]:
        bench.table(
            "every different-patient match",
            ["first", "second", "kind", "evidence", "mean |diff| after alignment"],
            [
                [Path(m["a"]).name, Path(m["b"]).name, m["kind"], m["evidence"], m["mean_abs_diff"]]
                for m in merges["different_patient_matches"]
            ],
        )
    bench.at_most("false merges among different patients' real images", len(false), 0)

    rows = scaling(args, config)
    bench.table(
        f"cost against decoding, {args.scale_px} px JPEG variants of the Kaggle images, CPU seconds in one process",
        [
            "images",
            "decode",
            "dedup features",
            "matching",
            "(features + matching) / decode",
            "matching wall s",
            "matching peak RSS MB",
            "matches",
        ],
        [
            [
                r["images"],
                f"{r['decode_cpu_s']:.1f}",
                f"{r['features_cpu_s']:.1f}",
                f"{r['matching_cpu_s']:.1f}",
                f"{r['dedup_over_decode']:.2f}",
                f"{r['matching_wall_s']:.1f}",
                f"{r['peak_rss_mb']:.0f}",
                r["matches"],
            ]
            for r in rows
        ],
    )
    bench.at_most(
        f"dedup (features + matching) / decode, {rows[-1]['images']} images", rows[-1]["dedup_over_decode"], 2.0
    )
    bench.finish(
        args,
        {
            "transform_suite": suite,
            "false_merges": merges,
            "scaling": rows,
            "settings": {
                "dedup_max_distance": config.dedup_max_distance,
                "dedup_min_inliers": config.dedup_min_inliers,
            },
        },
    )


if __name__ == "__main__":
    main()
