"""`covidxray report RUN_DIR`: one self-contained HTML page per run, a model card (Mitchell et al., 2019).

Sections: data card, training, evaluation, exported formats, Grad-CAM examples, intended use and limitations.
It is built only from what the run folder and its prepared data hold (covidxray/report/run_files.py); a part
whose file is missing says so. Images are embedded as data URIs; there is no script and no external resource,
so the file reads offline, in any browser, and prints to PDF.
"""

from __future__ import annotations

import datetime
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from covidxray.errors import UserError
from covidxray.files import atomic_write, output_folder
from covidxray.manifest import MANIFEST, PreparedData, check_model_matches
from covidxray.report import sections
from covidxray.report.html import esc, page, section
from covidxray.report.plots import training_curves
from covidxray.report.run_files import RunFiles
from covidxray.run_folder import (
    MODEL_CARD,
    MODEL_FILE,
    REPORT_FILE,
    TEST_PREDICTIONS,
    TRAIN_LOG,
    ModelCard,
)

SECTIONS = (  # (anchor, title): the page's order; tests check each is present
    ("data-card", "1. Data card"),
    ("training", "2. Training"),
    ("evaluation", "3. Evaluation"),
    ("exported-formats", "4. Exported formats"),
    ("examples", "5. Test images with Grad-CAM"),
    ("intended-use", "6. Intended use and limitations"),
)


def build_report(
    run_dir: Path, data_dir: Path | None = None, out: Path | None = None, say: Callable[[str], None] = print
) -> Path:
    """Write the report of `run_dir` to `out` (default RUN_DIR/report.html) and return its path."""
    from covidxray.sources import SOURCE_REGISTRY
    from covidxray.train.evaluate import CONFUSION_PLOT, RELIABILITY_PLOT, ROC_PLOT

    started = time.perf_counter()
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder: give the run folder `covidxray train --run-dir` wrote")
    files = RunFiles(run_dir, data_dir)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder: give the prepared data (with {MANIFEST})")
    out = Path(out) if out else run_dir / REPORT_FILE
    output_folder(out.parent, "--out")

    log = files.json(TRAIN_LOG)
    curves = training_curves(log["epochs"]) if log and log.get("epochs") else None
    plots = {name: files.binary(name) for name in (ROC_PLOT, CONFUSION_PLOT, RELIABILITY_PLOT)}
    card, data = files.model_card(), files.prepared()  # each read once, for the whole page
    found, problem, source = _examples(files, card, data)
    bodies = [
        sections.data_card(files, data),
        sections.training(files, curves, card),
        sections.evaluation(files, plots),
        sections.exported(files),
        sections.examples(found, card.labels if card else [], problem, source),
        sections.intended_use(files, data, SOURCE_REGISTRY.names()),
    ]
    html = page(
        f"covidxray report: {run_dir.name}",
        _header(files, card, data),
        [section(anchor, title, body) for (anchor, title), body in zip(SECTIONS, bodies)],
    )
    atomic_write(out, html)
    say(f"wrote {out} ({len(html.encode()) / 1e6:.2f} MB in {time.perf_counter() - started:.1f} s)")
    return out


def _header(files: RunFiles, card: ModelCard | None, data: PreparedData | None) -> str:
    same = ""
    if card is not None and data is not None and (card.dataset_id or card.manifest_sha256):
        same = (
            " The data folder is the one the model was trained on (its data set id matches the model card's)."
            if data.is_training_data_of(card)
            else " <b>The data folder is not the one the model was trained on</b> (its data set id differs from the model card's)."
        )
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"<h1>Model report: {esc(files.run_dir.name)}</h1>"
        f"<p class='note'>Run folder <code>{esc(files.run_dir.resolve())}</code>; written {when} by "
        f"<code>covidxray report</code> from the files named below.{same} Research use only, not a diagnostic "
        "device (section 6).</p>"
    )


def _examples(
    files: RunFiles, card: ModelCard | None, data: PreparedData | None
) -> tuple[list | None, str, str | None]:
    """(examples or None, why there are none / where the probabilities come from, file they come from or None)."""
    if data is None:
        return None, f"no prepared data to take test images from ({files.why_missing(MANIFEST)})", None
    if card is None:
        return None, f"no trained model ({files.why_missing(MODEL_CARD)})", None
    from covidxray.export.keras_file import load_keras_model
    from covidxray.report.examples import gradcam_examples

    try:
        check_model_matches(card, data)
        model = load_keras_model(files.run_dir / MODEL_FILE)
        predictions = files.run_dir / TEST_PREDICTIONS
        if predictions.is_file():
            try:
                with np.load(predictions) as saved:
                    labels, probabilities = saved["labels"], saved["probabilities"]
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
                raise UserError(f"{predictions} could not be read ({type(err).__name__}: {err})") from None
            source, note = TEST_PREDICTIONS, ""
        else:
            from covidxray.train.evaluate import predict_split

            probabilities, labels = predict_split(model, data, "test", card.image_size, len(card.labels))
            source = None
            note = (
                f"The probabilities shown were computed by the report: the run has no {TEST_PREDICTIONS} "
                "(evaluated by an older covidxray, or not evaluated)."
            )
        return gradcam_examples(model, data, labels, probabilities), note, source
    except UserError as err:
        return None, str(err), None
