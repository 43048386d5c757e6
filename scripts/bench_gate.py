"""The "is this a chest radiograph" gate: false rejections on real radiographs, rejections of everything else.

Every image goes through `covidxray.edge.predict.predict_path`, exactly what
`covidxray predict` runs: decoding (which already refuses colour photos and
DICOM whose Modality is not a radiograph), the cheap checks of
covidxray/edge/radiograph_gate.py, the orientation check
(covidxray/edge/orientation.py), the exported model's out-of-distribution
score, then the chest-layout score (covidxray/edge/chest_layout.py), each
against the threshold in the sidecar. An image counts as rejected when it
gets no class, whichever step refused it; the tables say which step did.
Both scores are also computed for every image that reaches the model, so the
margin table shows what other export.ood_margin / export.layout_margin
values would give without exporting again.

The image sets are described in scripts/gate_corpus.py: every real
radiograph in ../shared/data (about 6,000), and photos, documents, blank
images, noise, CT slices and other body parts. DICOM non-radiographs are also
fed as gray PNGs of their pixels ("pixels" rows): only the gate itself can
refuse those.

Then the held-out set of scripts/gate_held_out.py (64 images; more when
mahotas happens to be installed): photos, an MR slice and elevation maps from sources the
corpus does not use, in several forms, screenshots of real films beside a text
panel, a grid of four films and phone-style photos of a film on a desk, each
of which must be refused (an unreadable one counts as refused). It is held
out: nothing (threshold, fit, rule, corpus entry) may be chosen by looking at
its figures; a change that was makes it no longer held out, and the docs must
then say so.

The model: --run-dir, an exported run (the figures in docs/deploy.md come from
small_cnn trained on the real three-class collection; the command is there).
Without it (--quick), a phantom model is trained here and the figures mean
nothing. Goals (issues 14, 25): 0% false rejections, >= 99% of non-radiographs
rejected (>= 97% of the held-out set), and no odd film (real films inverted or
upside down, scripts/gate_corpus.py) given another class than the upright film.
Halves of the same films (left, right, top) are measured the same way, with no goal: no issue has set one.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import _bench
import gate_corpus
import gate_held_out

from covidxray.edge.orientation import ARRAYS as ORIENTATION_ARRAYS
from covidxray.edge.orientation import ORIENTATIONS
from covidxray.edge.predict import LAYOUT_REASON, OOD_REASON, predict_path
from covidxray.sidecar import Sidecar

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): the predict path and its checks, and the image sets (the model is an input: --run-dir).
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/edge",
    "scripts/gate_corpus.py",
    "scripts/gate_held_out.py",
)


REJECTED_BY = ("decoder", "cheap checks", "orientation", "ood score", "chest layout")
ORIENTATION_REASONS = set(ORIENTATIONS[1:])
ODD_COLLECTIONS = ("chest-xray-pneumonia-224", "covid19-talo-nih-half-512", "covid-chestxray-aug2020-768")
REACHED_THE_MODEL = ("classified", "ood score", "chest layout")


def outcome(result: dict) -> str:
    """'classified', 'unreadable' (a radiograph this install cannot decode), or which step refused it."""
    if "label" in result:
        return "classified"
    if "rejected" in result:
        if result["reason"] in ORIENTATION_REASONS:
            return "orientation"
        return {OOD_REASON: "ood score", LAYOUT_REASON: "chest layout"}.get(result["reason"], "cheap checks")
    return "unreadable" if result["reason"] in ("unreadable", "unsupported") else "decoder"


class Measured(NamedTuple):
    counts: dict[tuple[str, str], Counter]  # (category, form): how many images got each outcome
    scores: list[tuple[str, float, float]]  # (file (form), OOD distance, layout score) of each that reached the model
    refused_before: int  # refused before the model (an unreadable non-radiograph counts as refused)
    wrong: list[tuple[gate_corpus.Item, dict]]  # radiographs refused or non-radiographs classified, with the result


def measure(kind: str, items: list[gate_corpus.Item], classifier, scores: bool = True) -> Measured:
    """`predict_path` over `items`, each a real radiograph (`kind` "radiograph": it must be classified; one this
    install cannot decode is left out) or a non-radiograph ("other": it must be refused; an unreadable one counts
    as refused). `scores`: also compute both scores of every image that reached the model."""
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    scored, refused_before, wrong = [], 0, []
    for item in items:
        result = predict_path(item.path, classifier)
        step = outcome(result)
        counts[(item.category, item.form)][step] += 1
        if step in REACHED_THE_MODEL:
            if scores:
                scored.append((f"{item.path} ({item.form})", *model_scores(item.path, classifier)))
        elif step != "unreadable" or kind == "other":
            refused_before += 1
        if (kind == "radiograph" and step not in ("classified", "unreadable")) or (
            kind == "other" and step == "classified"
        ):
            wrong.append((item, result))
    return Measured(counts, scored, refused_before, wrong)


def held_out_outcomes(measured: Measured) -> tuple[list[list], dict]:
    """The held-out table's rows (category, form, images, classified, refused, rejected share) and its results."""
    rows, by_category = [], {}
    for (category, form), seen in sorted(measured.counts.items()):
        images = sum(seen.values())
        refused = images - seen["classified"]  # an unreadable image counts as refused
        by_category[f"{category}/{form}"] = {"images": images, **seen, "rejected_share": refused / images}
        rows.append([category, form, images, seen["classified"], refused, f"{refused / images:.1%}"])
    images = sum(sum(seen.values()) for seen in measured.counts.values())
    rejected = images - len(measured.wrong)
    return rows, {
        "images": images,
        "rejected": rejected,
        "rejection_rate": rejected / images,
        "by_category": by_category,
        "classified": [item.path.name for item, _ in measured.wrong],
    }


def model_scores(path: Path, classifier) -> tuple[float, float]:
    """(OOD distance, chest-layout score) of an image that reached the model; inf for a check the sidecar lacks."""
    from covidxray.edge.preprocess import as_model_input, load_gray

    image = as_model_input(load_gray(path), classifier.image_size)
    distance = classifier.ood_distance(classifier.infer(image)[1])
    layout = classifier.layout.score(image) if classifier.layout else None
    return (float("inf") if distance is None else distance), (float("inf") if layout is None else layout)


def margin_sensitivity(
    card: Sidecar, scores: dict[str, list[tuple[str, float, float]]], refused_before: Counter, judged: Counter
) -> list[dict]:
    """Both goals at other margins, from the two scores (file, OOD, layout) of every image that reached the model.

    `refused_before[kind]`: images of that kind the decoder or the cheap checks refused (they stay refused);
    `judged[kind]`: the denominators. A margin of None: that check off.
    """
    ood, layout = card.ood, card.layout
    if not ood:
        return []
    ood_max = ood["val_distance"]["max"]
    layout_max = layout["val_score"]["max"] if layout else float("inf")
    ood_margins = sorted({ood["margin"], 1.2, 1.5, 2.0, 3.0})
    layout_margins = [None, *sorted({layout["margin"], 1.0, 1.2, 1.3, 1.5, 2.0})] if layout else [None]
    rows = []
    for ood_margin in ood_margins:
        for layout_margin in layout_margins:
            layout_limit = float("inf") if layout_margin is None else layout_max * layout_margin
            refused = {
                kind: refused_before[kind]
                + sum(d > ood_max * ood_margin or s > layout_limit for _, d, s in scores[kind])
                for kind in ("radiograph", "other")
            }
            rows.append(
                {
                    "ood_margin": ood_margin,
                    "layout_margin": layout_margin,
                    "false_rejections": refused["radiograph"],
                    "false_rejection_rate": refused["radiograph"] / judged["radiograph"],
                    "rejected": refused["other"],
                    "rejection_rate": refused["other"] / judged["other"],
                }
            )
    return rows


def copy_outcomes(pairs, classifier) -> tuple[list[list], list[dict]]:
    """Per kind of copy of a real film (odd, partial): how many were refused, given the film's class, or another.

    Returns the table rows and every copy that got another class than its film.
    """
    counts: dict[tuple, Counter] = defaultdict(Counter)
    wrong = []
    films: dict[Path, dict] = {}  # each film's own answer, once for all of its copies
    for film, odd, view in pairs:
        if film not in films:
            films[film] = predict_path(film, classifier)
        upright, result = films[film], predict_path(odd, classifier)
        collection = next(
            (part for part in film.parts if part in ODD_COLLECTIONS), "stored odd (gate_corpus.KNOWN_ODD)"
        )
        if "label" not in result:
            seen = "refused"
        elif result["label"] == upright.get("label"):
            seen = "same class"
        else:
            seen = "other class"
            wrong.append(
                {"file": str(odd), "view": view, "upright": upright.get("label", upright.get("reason")), **result}
            )
        counts[(view, collection)][seen] += 1
    rows = [
        [view, collection, sum(c.values()), c["refused"], c["same class"], c["other class"]]
        for (view, collection), c in sorted(counts.items())
    ]
    return rows, wrong


def build_run(args) -> Path:
    run_dir = args.workdir / "gate-run"
    if (run_dir / f"model-{args.format}.tflite").is_file():
        return run_dir
    data = _bench.prepared_synthetic(args.workdir / "gate-data", 32, 40)
    _bench.run(_bench.covidxray("train", "--data-dir", str(data), "--run-dir", str(run_dir), "--epochs", "1"))
    _bench.run(
        _bench.covidxray(
            "export",
            "--run-dir",
            str(run_dir),
            "--data-dir",
            str(data),
            f"--format={args.format}",
            "--set",
            "export.int8_min_agreement=0",
        )
    )
    return run_dir


def main() -> None:
    bench = _bench.Bench("gate", __doc__)
    bench.parser.add_argument("--run-dir", type=Path, help="exported run (default: a phantom model trained here)")
    bench.parser.add_argument("--format", default="float32", help="which model-<format>.tflite (default: %(default)s)")
    bench.parser.add_argument(
        "--shared", type=Path, default=_bench.REPO.parent / "shared" / "data", help="real data (default: %(default)s)"
    )
    bench.parser.add_argument("--every", type=int, default=1, help="use every n-th real radiograph (default: all)")
    args = bench.parse({"every": 60})
    from covidxray.edge.litert import TFLiteClassifier

    run_dir = args.run_dir or build_run(args)
    classifier = TFLiteClassifier(run_dir / f"model-{args.format}.tflite")
    radiographs = gate_corpus.radiographs(args.shared)[:: args.every]
    others = gate_corpus.non_radiographs(args.shared, args.workdir / "gate-corpus")
    counts: dict[tuple, Counter] = {}
    scores: dict[str, list[tuple[str, float, float]]] = {}  # (file, OOD, layout)
    refused_before = Counter()  # before the model (an unreadable non-radiograph counts as refused)
    wrong = {}
    for kind, items in (("radiograph", radiographs), ("other", others)):
        measured = measure(kind, items, classifier)
        counts.update({(kind, *key): seen for key, seen in measured.counts.items()})
        scores[kind], refused_before[kind], wrong[kind] = measured.scores, measured.refused_before, measured.wrong
    refused_radiographs = [{"file": str(item.path), **result} for item, result in wrong["radiograph"]]
    passed_others = [str(item.path) for item, _ in wrong["other"]]
    rows, table = [], {}
    for (kind, category, form), seen in sorted(counts.items()):
        judged = sum(seen.values()) - (seen["unreadable"] if kind == "radiograph" else 0)
        refused = sum(seen[s] for s in REJECTED_BY) + (0 if kind == "radiograph" else seen["unreadable"])
        table[f"{kind}/{category}/{form}"] = {
            "images": sum(seen.values()),
            **seen,
            "rejected_share": refused / judged if judged else None,
        }
        rows.append(
            [
                kind,
                category,
                form,
                sum(seen.values()),
                seen["classified"],
                seen["unreadable"],
                *(seen[s] for s in REJECTED_BY),
                f"{refused / judged:.1%}" if judged else "-",
            ]
        )
    bench.table(
        f"predict on real radiographs and on non-radiographs ({classifier.card.model} @{classifier.image_size} px, {args.format}, "
        f"OOD threshold {classifier.ood.threshold if classifier.ood else float('nan'):.2f}, "
        f"chest-layout threshold {classifier.layout.threshold if classifier.layout else float('nan'):.2f})",
        [
            "set",
            "category",
            "form",
            "images",
            "classified",
            "unreadable",
            *(f"refused: {s}" for s in REJECTED_BY),
            "rejected",
        ],
        rows,
    )

    judged_radiographs = sum(
        sum(v.values()) - v["unreadable"] for (kind, _, _), v in counts.items() if kind == "radiograph"
    )
    false_rejection = len(refused_radiographs) / judged_radiographs
    total_others = sum(sum(v.values()) for (kind, _, _), v in counts.items() if kind == "other")
    rejection = 1 - len(passed_others) / total_others
    pixel_others = [v for (kind, _, form), v in counts.items() if kind == "other" and form == "pixels"]
    odd_rows, odd_wrong = copy_outcomes(gate_corpus.odd_films(args.shared, args.workdir / "gate-corpus"), classifier)
    bench.table(
        "odd films: real films shown inverted or upside down (each must be refused or get the upright film's class)",
        ["view", "collection", "films", "refused", "same class", "other class"],
        odd_rows,
    )
    partial_rows, partial_wrong = copy_outcomes(
        gate_corpus.partial_films(args.shared, args.workdir / "gate-corpus"), classifier
    )
    bench.table(
        "partial films: half of a real film (no goal; refused or the whole film's class is what a user can trust)",
        ["part", "collection", "films", "refused", "same class", "other class"],
        partial_rows,
    )
    margins = margin_sensitivity(
        classifier.card, scores, refused_before, Counter(radiograph=judged_radiographs, other=total_others)
    )
    if margins:
        bench.table(
            "other export.ood_margin / export.layout_margin (from both scores of every image that reached the model; off: no layout check)",
            ["ood_margin", "layout_margin", "false rejections", "non-radiographs rejected"],
            [
                [
                    m["ood_margin"],
                    "off" if m["layout_margin"] is None else m["layout_margin"],
                    f"{m['false_rejections']} ({m['false_rejection_rate']:.2%})",
                    f"{m['rejected']} ({m['rejection_rate']:.1%})",
                ]
                for m in margins
            ],
        )
    # The held-out set (scripts/gate_held_out.py), measured after the corpus: nothing may be chosen on it.
    held_out_rows, held_out = held_out_outcomes(
        measure("other", gate_held_out.held_out(args.shared, args.workdir / "gate-held-out"), classifier, scores=False)
    )
    bench.table(
        "held out (scripts/gate_held_out.py; never used to choose a threshold, fit, rule or corpus entry)",
        ["category", "form", "images", "classified", "refused", "rejected"],
        held_out_rows,
    )
    results = {
        "run_dir": str(run_dir),
        "format": args.format,
        "model": classifier.card.model,
        "image_size": classifier.image_size,
        "ood": {k: v for k, v in (classifier.card.ood or {}).items() if k not in ("means", "precision")},
        "layout": {k: v for k, v in (classifier.card.layout or {}).items() if k not in ("mean", "precision")},
        "orientation": {k: v for k, v in (classifier.card.orientation or {}).items() if k not in ORIENTATION_ARRAYS},
        "radiographs_judged": judged_radiographs,
        "false_rejection_rate": false_rejection,
        "refused_radiographs": refused_radiographs,
        "non_radiographs": total_others,
        "rejection_rate": rejection,
        "non_radiographs_classified": passed_others,
        "margin_sensitivity": margins,
        "non_radiographs_scored": scores["other"],  # [file (form), OOD distance, layout score]
        "radiographs_highest": {  # the five real radiographs nearest to each threshold
            name: sorted(scores["radiograph"], key=lambda row: -row[column])[:5]
            for column, name in ((1, "ood"), (2, "layout"))
        },
        "pixels_only_rejection_rate": 1
        - sum(v["classified"] for v in pixel_others) / max(1, sum(sum(v.values()) for v in pixel_others)),
        "by_category": table,
        "odd_films": {"table": odd_rows, "other_class": odd_wrong},
        "partial_films": {"table": partial_rows, "other_class": partial_wrong},
        "held_out": held_out,
    }
    bench.at_most(
        "false rejections of real radiographs",
        false_rejection,
        0.0,
        f"{len(refused_radiographs)} of {judged_radiographs}",
    )
    bench.at_least(
        "non-radiographs rejected",
        rejection,
        0.99,
        f"{total_others - len(passed_others)} of {total_others}; classified: "
        + ", ".join(Path(p).name for p in passed_others[:8]),
    )
    bench.at_least(
        "held-out non-radiographs rejected",
        held_out["rejection_rate"],
        0.97,
        f"{held_out['rejected']} of {held_out['images']}; classified: " + ", ".join(held_out["classified"][:8]),
    )
    bench.at_most(
        "odd films given another class than the upright film",
        len(odd_wrong),
        0,
        ", ".join(f"{Path(w['file']).name} {w['label']} (upright: {w['upright']})" for w in odd_wrong[:6]),
    )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
