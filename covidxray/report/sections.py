"""The report's sections, one function each, from the files `RunFiles` read; a part whose file is missing says so.

Each number is printed with `figure`, naming the file and JSON pointer it came from (see covidxray/report/html.py).
"""

from __future__ import annotations

from collections import Counter

from covidxray.data.composition import SOURCE_TRAITS
from covidxray.manifest import DROPPED_TABLE, DUPLICATE_TABLE, MANIFEST, SPLITS, Manifest, PreparedData, SplitSummary
from covidxray.report.html import esc, figure, missing, number, png, pointer, ref, table, text_from
from covidxray.report.run_files import RunFiles
from covidxray.reports import (
    ClassMetrics,
    ExternalReport,
    SourceMetrics,
    Thresholds,
    read_evaluation_report,
    read_export_report,
)
from covidxray.run_folder import CONFIG_FILE, EVALUATION, EXPORT_REPORT, MODEL_CARD, TRAIN_LOG, ModelCard, sidecar_path
from covidxray.sidecar import Sidecar

TOP_REASONS = 5
# The train.* settings that decide what is learned (the rest: Horovod tuning, paths, seeds, are in config.yaml).
TRAIN_SETTINGS = (
    "model",
    "weights",
    "epochs",
    "batch_size",
    "learning_rate",
    "warmup_epochs",
    "lr_schedule",
    "label_smoothing",
    "class_weights",
    "class_weight_power",
    "augment",
    "augment_strength",
    "sampling",
    "degrade",
    "source_adversary",
    "frozen_stages",
    "freeze_batchnorm",
    "bn_recalibration_images",
    "early_stopping_patience",
)


def _recorded(mapping: dict, key: str, source: str) -> str:
    """A text value of a file, or "not recorded" when the file has no such key."""
    return text_from(mapping[key], source) if key in mapping else "not recorded"


def _text_or_not_recorded(value: object, source: str) -> str:
    """A text value of a loaded file, or "not recorded" when the file holds none (None)."""
    return text_from(value, source) if value is not None else "not recorded"


def _figures(entry: object, at: str, keys: tuple[str, ...]) -> list[str]:
    """The figures `keys` of `entry` (a report's typed entry; None: not there, each figure n/a), which sits at `at`
    (file#pointer) in its file."""
    return [figure(getattr(entry, key) if entry is not None else None, at + pointer(key)) for key in keys]


def _rerun(command: str) -> str:
    return f"Run `{command}` to add it."


# --- data card --------------------------------------------------------------------------------------------


def data_card(files: RunFiles, data: PreparedData | None) -> str:
    """`data`: the run's prepared data as `files.prepared()` read it (None: missing, `files` says why)."""
    if data is None:
        return missing(f"the data card ({MANIFEST} of the prepared data)", files.why_missing(MANIFEST))
    manifest = data.manifest
    parts = [
        f"<p>Prepared data: <code>{esc(files.data_dir)}</code> (from {esc(files.data_dir_origin)}); task "
        f"{text_from(manifest.task, ref(MANIFEST, 'task'))}, image size "
        f"{figure(manifest.image_size, ref(MANIFEST, 'image_size'))} px, harmonisation "
        f"{text_from(manifest.harmonise, ref(MANIFEST, 'harmonise'))}. Manifest sha256 "
        f"{text_from(manifest.checksum['sha256'], ref(MANIFEST, 'checksum', 'sha256'))}.</p>",
        _sources_table(manifest),
        _split_tables(manifest),
        _shortcut_warnings(manifest),
        _dropped(files, manifest),
        _duplicates(files, manifest),
    ]
    return "".join(parts)


def _sources_table(manifest: Manifest) -> str:
    rows = []
    for name, info in manifest.sources.items():
        at = ref(MANIFEST, "sources", name)
        version = [
            f"{key} {text_from(info[key], at + pointer(key))}" for key in ("version", "commit", "sha256") if key in info
        ]
        rows.append(
            [
                esc(name),
                esc(SOURCE_TRAITS.get(name, "")),
                _recorded(info, "licence", at + pointer("licence")),
                _recorded(
                    info, "from" if "from" in info else "root", at + pointer("from" if "from" in info else "root")
                ),
                "; ".join(version) or "not recorded by the source",
                figure(info.get("records_found"), at + pointer("records_found")),
                figure(info.get("records_kept"), at + pointer("records_kept")),
            ]
        )
    return "<h3>Sources</h3>" + table(
        ["source", "population", "licence", "read from", "version / hash", "records found", "kept"],
        rows,
        numeric_from=5,
    )


def _split_tables(manifest: Manifest) -> str:
    labels = manifest.labels
    splits: dict[str, SplitSummary] = manifest.splits  # every split is there: open_prepared refuses a manifest without
    rows = []
    for split in SPLITS:
        info = splits[split]
        at = ref(MANIFEST, "splits", split)
        rows.append(
            [
                esc(split),
                figure(info.records, at + pointer("records")),
                figure(info.patients, at + pointer("patients")),
            ]
            + [figure(info.classes.get(c, 0), at + pointer("classes", c)) for c in labels]
        )
    by_source = []
    for split in SPLITS:
        for source, counts in splits[split].source_classes.items():
            at = ref(MANIFEST, "splits", split, "source_classes", source)
            by_source.append([esc(split), esc(source)] + [figure(counts.get(c, 0), at + pointer(c)) for c in labels])
    patient_note = (
        "Patients are disjoint across splits."
        if manifest.patient_disjoint
        else "The manifest does not record the splits as patient-disjoint."
    )
    return (
        "<h3>Classes per split</h3>"
        + table(["split", "images", "patients", *labels], rows)
        + f"<p class='note'>{patient_note}</p><h3>Classes per split and source</h3>"
        + table(["split", "source", *labels], by_source, numeric_from=2)
    )


def _shortcut_warnings(manifest: Manifest) -> str:
    warnings = manifest.composition_warnings
    if not warnings:
        return "<h3>Shortcut warnings</h3><p>None: no class comes mostly from one source.</p>"
    items = "".join(f'<li class="warning">{esc(w)}</li>' for w in warnings)
    return f"<h3>Shortcut warnings</h3><ul>{items}</ul>"


def _top(rows: list[dict], column: str, table_name: str, header: str) -> str:
    """The most frequent values of `column` in a data table, with their row counts; "none" for an empty table."""
    counts = Counter(row.get(column, "") for row in rows).most_common(TOP_REASONS)
    if not counts:
        return f"<p>{esc(table_name)} lists none.</p>"
    cells = [[esc(value), figure(n, f"csv-count:{table_name}#{column}={value}")] for value, n in counts]
    return f"<p>Top {esc(header)} ({esc(table_name)}):</p>" + table([header, "rows"], cells)


def _dropped(files: RunFiles, manifest: Manifest) -> str:
    total = figure(manifest.dropped_total, ref(MANIFEST, "dropped_total"))
    rows = files.rows(DROPPED_TABLE)
    if rows is None:
        return f"<h3>Dropped</h3><p>{total} records dropped.</p>" + missing(
            DROPPED_TABLE, files.why_missing(DROPPED_TABLE)
        )
    return f"<h3>Dropped</h3><p>{total} records dropped (rows or files not used).</p>" + _top(
        rows, "reason", DROPPED_TABLE, "reasons"
    )


def _duplicates(files: RunFiles, manifest: Manifest) -> str:
    removed = manifest.duplicates_removed
    at = ref(MANIFEST, "duplicates_removed")
    kinds = ", ".join(
        f"{esc(kind)} {figure(removed[kind], at + pointer(kind))}"
        for kind in ("exact", "perceptual", "geometric", "label_conflicts_dropped")
        if kind in removed
    )
    head = (
        f"<h3>Duplicates</h3><p>{figure(removed.get('total', 0), at + pointer('total'))} copies removed ({kinds}).</p>"
    )
    rows = files.rows(DUPLICATE_TABLE)
    if rows is None:
        return head + missing(DUPLICATE_TABLE, files.why_missing(DUPLICATE_TABLE))
    return head + _top(rows, "evidence", DUPLICATE_TABLE, "evidence")


# --- training ---------------------------------------------------------------------------------------------


def training(files: RunFiles, curves: str | None, card: ModelCard | None) -> str:
    """`curves`: the training curves as inline SVG (covidxray/report/plots.py), None without a log; `card`: the
    run's model card as `files.model_card()` read it (None: missing, `files` says why)."""
    config, log = files.yaml(CONFIG_FILE), files.json(TRAIN_LOG)
    parts = []
    if config is None:
        parts.append(missing(f"the training settings ({CONFIG_FILE})", files.why_missing(CONFIG_FILE)))
    else:
        train = config.get("train", {})
        rows = [[esc(k), text_from(train[k], ref(CONFIG_FILE, "train", k))] for k in TRAIN_SETTINGS if k in train]
        parts.append("<h3>Settings that matter</h3>" + table(["train.*", "value"], rows))
    if card is None:
        parts.append(missing(f"the model card ({MODEL_CARD}: best epoch, labels)", files.why_missing(MODEL_CARD)))
    else:
        parts.append(
            f"<p>Saved model: {_text_or_not_recorded(card.model, ref(MODEL_CARD, 'model'))}, best epoch "
            f"{figure(card.best.get('epoch'), ref(MODEL_CARD, 'best', 'epoch'))} by validation AUC "
            f"{figure(card.best.get('val_auc'), ref(MODEL_CARD, 'best', 'val_auc'))}.</p>"
        )
    if log is None:
        parts.append(missing(f"the training log ({TRAIN_LOG})", files.why_missing(TRAIN_LOG)))
        return "".join(parts)
    epochs = log.get("epochs", [])
    wall = figure(
        float(sum(e.get("seconds", 0) for e in epochs)), "sum:" + ref(TRAIN_LOG, "epochs", "*", "seconds"), ".1f"
    )
    parts.append(
        f"<p>{figure(log.get('world_size'), ref(TRAIN_LOG, 'world_size'))} rank(s), "
        f"{figure(log.get('steps_per_epoch'), ref(TRAIN_LOG, 'steps_per_epoch'))} steps per epoch, "
        f"{figure(len(epochs), 'count:' + ref(TRAIN_LOG, 'epochs'))} epochs logged; wall time of the training "
        f"passes {wall} s "
        "(validation and checkpoints not included).</p>"
    )
    if curves:
        parts.append(curves)
    parts.append(_ranks(log))
    parts.append(_epoch_table(epochs))
    return "".join(parts)


def _ranks(log: dict) -> str:
    ranks = log.get("ranks", [])
    last = (log.get("epochs") or [{}])[-1]
    rates = last.get("images_per_s_per_rank") or []
    epoch_at = ref(TRAIN_LOG, "epochs", len(log.get("epochs", [])) - 1, "images_per_s_per_rank")
    rows = []
    for i, rank in enumerate(ranks):
        at = ref(TRAIN_LOG, "ranks", i)
        rate = figure(rates[i], epoch_at + pointer(i), ".1f") if i < len(rates) else "n/a"
        rows.append(
            [
                figure(rank.get("rank"), at + pointer("rank")),
                _recorded(rank, "host", at + pointer("host")),
                f"{len(rank.get('shards', []))}",
                rate,
            ]
        )
    return "<h3>Ranks and throughput (last epoch)</h3>" + table(
        ["rank", "host", "shard files", "images/s"], rows, numeric_from=2
    )


def _epoch_table(epochs: list[dict]) -> str:
    keys = [
        ("loss", ".4f"),
        ("val_loss", ".4f"),
        ("val_accuracy", ".3f"),
        ("val_auc", ".3f"),
        ("lr", ".3g"),
        ("seconds", ".1f"),
    ]
    rows = [
        [figure(e["epoch"], ref(TRAIN_LOG, "epochs", i, "epoch"))]
        + [figure(e.get(k), ref(TRAIN_LOG, "epochs", i, k), fmt) for k, fmt in keys]
        for i, e in enumerate(epochs)
    ]
    return "<h3>Per epoch</h3>" + table(["epoch", *(k for k, _ in keys)], rows, numeric_from=0)


# --- evaluation -------------------------------------------------------------------------------------------


def evaluation(files: RunFiles, plots: dict[str, bytes | None]) -> str:
    report = files.artifact(EVALUATION, read_evaluation_report)
    if report is None:
        return missing(
            f"the evaluation ({EVALUATION})",
            files.why_missing(EVALUATION) + ". " + _rerun("covidxray evaluate --run-dir RUN --data-dir DATA"),
        )
    at = EVALUATION + "#"
    calibration = report.calibration
    parts = [
        f"<p>Split {text_from(report.split, at + pointer('split'))}: "
        f"{figure(report.images, at + pointer('images'))} images, accuracy "
        f"{figure(report.accuracy, at + pointer('accuracy'))}, macro ROC AUC "
        f"{figure(report.macro_roc_auc, at + pointer('macro_roc_auc'))}, ECE "
        f"{figure(calibration.ece, at + pointer('calibration', 'ece'))} "
        f"({figure(calibration.bins, at + pointer('calibration', 'bins'))} bins). "
        "Confidence intervals: evaluation.json holds none, so none are shown.</p>",
        _per_class(report.per_class, at + pointer("per_class")),
        _thresholds(report.thresholds),
        _per_source(report.per_source),
        _external(report.external),
        "<h3>ROC, confusion matrix, reliability</h3><div class='figures'>",
    ]
    for name, data in plots.items():
        parts.append(png(data, name) if data else missing(name, files.why_missing(name)))
    parts.append("</div>")
    return "".join(parts)


def _per_class(per_class: dict[str, ClassMetrics], at: str) -> str:
    rows = []
    for name, entry in per_class.items():
        here = at + pointer(name)
        point = entry.operating_point
        rates = ("sensitivity", "specificity", "ppv")
        rows.append(
            [esc(name)]
            + _figures(entry, here, ("support", "roc_auc"))
            + _figures(entry.argmax, here + pointer("argmax"), rates)
            + _figures(point, here + pointer("operating_point"), ("threshold", *rates))
        )
    headers = [
        "class",
        "support",
        "ROC AUC",
        "sens. (argmax)",
        "spec. (argmax)",
        "PPV (argmax)",
        "threshold",
        "sens. (thr.)",
        "spec. (thr.)",
        "PPV (thr.)",
    ]
    return "<h3>Per class</h3>" + table(headers, rows)


def _thresholds(thresholds: Thresholds) -> str:
    at = ref(EVALUATION, "thresholds")
    return (
        f"<p>Thresholds: chosen on {text_from(thresholds.chosen_on, at + pointer('chosen_on'))} "
        f"({figure(thresholds.val_images, at + pointer('val_images'))} images), rule "
        f"{text_from(thresholds.rule, at + pointer('rule'))}.</p>"
    )


def _per_source(per_source: dict[str, SourceMetrics]) -> str:
    if not per_source:
        return "<h3>Per source</h3><p>evaluation.json has no per-source metrics.</p>"
    rows = []
    for source, entry in per_source.items():
        at = ref(EVALUATION, "per_source", source)
        rows.append(
            [esc(source) + (" (unseen in training)" if entry.unseen else "")]
            + _figures(entry, at, ("images", "train_images", "accuracy", "macro_roc_auc", "ece"))
        )
    return "<h3>Per source</h3>" + table(
        ["source", "test images", "train images", "accuracy", "macro AUC", "ECE"], rows
    )


def _external(external: list[ExternalReport]) -> str:
    if not external:
        return ""
    rows = []
    for i, entry in enumerate(external):
        at = ref(EVALUATION, "external", i)
        rows.append(
            [esc(entry.data_dir)]
            + _figures(entry, at, ("images", "dropped_as_copies", "accuracy", "macro_roc_auc", "ece"))
        )
    return "<h3>External data sets</h3>" + table(
        ["data", "images", "dropped as copies", "accuracy", "macro AUC", "ECE"], rows
    )


# --- exported formats -------------------------------------------------------------------------------------


def exported(files: RunFiles) -> str:
    report = files.artifact(EXPORT_REPORT, read_export_report)
    if report is None:
        return missing(
            f"the export ({EXPORT_REPORT})",
            files.why_missing(EXPORT_REPORT) + ". " + _rerun("covidxray export --run-dir RUN --data-dir DATA"),
        )
    rows, notes = [], []
    for fmt, entry in report.formats.items():
        at = ref(EXPORT_REPORT, fmt)
        sidecar_name = sidecar_path(files.run_dir / entry.file).name
        sidecar = files.sidecar(sidecar_name)
        if sidecar is None:
            notes.append(missing(f"the sidecar of {fmt} ({sidecar_name})", files.why_missing(sidecar_name)))
        rows.append(
            [
                esc(fmt),
                figure(entry.bytes * 1e-6, f"scale:1e-6:{at}{pointer('bytes')}", ".2f"),
                *_figures(entry, at, ("agreement", "accuracy", "accuracy_delta")),
                *_sidecar_figures(sidecar, sidecar_name),
            ]
        )
    at = EXPORT_REPORT + "#"
    head = (
        f"<p>Checked against Keras on {figure(report.test_images, at + pointer('test_images'))} test images; "
        f"int8 must agree on at least {figure(report.int8_min_agreement, at + pointer('int8_min_agreement'))} of them. "
        "Latency is not measured by export (see scripts/bench_predict.py).</p>"
    )
    headers = [
        "format",
        "size (MB)",
        "agreement with Keras",
        "accuracy",
        "accuracy delta",
        "temperature",
        "OOD gate threshold",
        "layout gate threshold",
    ]
    return head + table(headers, rows) + "".join(notes)


def _sidecar_figures(sidecar: Sidecar | None, name: str) -> list[str]:
    """Temperature and the two gates' thresholds of a format's sidecar; n/a, cited from nothing, when it is
    missing (the note under the table says why)."""
    if sidecar is None:
        return ["n/a"] * 3
    fits = {"ood": sidecar.ood or {}, "layout": sidecar.layout or {}}
    return [
        figure(sidecar.temperature_value, ref(name, "temperature", "value")),
        *(figure(fit.get("threshold"), ref(name, gate, "threshold"), ".2f") for gate, fit in fits.items()),
    ]


# --- examples and intended use ----------------------------------------------------------------------------


def examples(found: list | None, labels: list[str], problem: str, source: str | None) -> str:
    """`found`: Example objects (covidxray/report/examples.py), or None with `problem` saying why there are none.

    `source`: the file the probabilities come from (TEST_PREDICTIONS), or None when the report predicted them.
    """
    if found is None:
        return missing("the Grad-CAM examples", problem)
    cards = []
    for example in found:
        probability = (
            figure(example.probability, ref(source, "probabilities", example.index, example.predicted))
            if source
            else esc(number(example.probability))
        )
        cards.append(
            f'<div class="example">{png(example.original_png, "test image")}{png(example.gradcam_png, "Grad-CAM")}'
            f"<br><b>{esc(example.kind)}</b>, test image {esc(example.index)}: true {esc(labels[example.truth])}, "
            f"predicted {esc(labels[example.predicted])} with p = {probability}</div>"
        )
    note = (
        "<p class='note'>Most confident errors first, then the most confident correct case per class; heat: "
        "Grad-CAM of the predicted class on the Keras model (where the model looked, not a finding)."
        + ("" if source else f" {esc(problem)}")
        + "</p>"
    )
    return note + (f'<div class="examples">{"".join(cards)}</div>' if cards else "<p>No test images.</p>")


INTENDED_USE = (
    "<p><b>Research use only. This model is not a medical device and must not be used to diagnose, triage or "
    "treat anyone.</b> It was trained on public research collections and evaluated on a held-out part of the same "
    "collections; that is no clinical validation. A radiologist's reading, the patient's history and tests decide; "
    "a heat map shows where the model looked, not a finding.</p>"
)


def intended_use(files: RunFiles, data: PreparedData | None, registered_sources: list[str]) -> str:
    if data is None:
        seen = missing("which sources and populations the model has seen", files.why_missing(MANIFEST))
    else:
        manifest = data.manifest
        names = list(manifest.sources)
        seen_items = "".join(
            f"<li>{esc(n)}{esc(' (' + SOURCE_TRAITS[n] + ')') if n in SOURCE_TRAITS else ''}</li>" for n in names
        )
        unseen = [n for n in registered_sources if n not in names]
        unseen_items = "".join(
            f"<li>{esc(n)}{esc(' (' + SOURCE_TRAITS[n] + ')') if n in SOURCE_TRAITS else ''}</li>" for n in unseen
        )
        labels = ", ".join(esc(c) for c in manifest.labels)
        seen = (
            f"<p>It tells apart only: {labels} (task {esc(manifest.task)}), on frontal chest radiographs "
            f"resized to {esc(manifest.image_size)} px. Any other finding, view, body part or modality is "
            "outside what it has seen.</p>"
            f"<h3>Seen in training (from the manifest)</h3><ul>{seen_items}</ul>"
            f"<h3>Not seen</h3><ul>{unseen_items}<li>every hospital, scanner, age group and population not in the list "
            "above; a different mix of classes than in the split tables (its PPV would differ)</li></ul>"
        )
    return INTENDED_USE + seen
