"""The reports `evaluate` and `export` write into a run folder: EVALUATION and EXPORT_REPORT (covidxray/run_folder.py).

Contract: `EvaluationReport` (the test split's metrics, per class, calibration, per source, and one
`ExternalReport` per `evaluate --external` data set) and `ExportReport` (the Keras reference and one `FormatEntry`
per exported format) are frozen dataclasses. `write_evaluation_report` / `read_evaluation_report` and
`write_export_report` / `read_export_report` are their one writer and one reader; the readers load with the
config's strict coercion (covidxray/strict.py), so a damaged or edited file is a UserError naming the file and the
key, and a file of another `version` one clear message (a file without `version` was written before the field
existed, in this same layout: version 1). `evaluation_report` / `export_report` build a report from the JSON its
command assembles, with the same checks. Imports only the standard library and covidxray's light modules: the
report page (covidxray/report/) and the benchmarks read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from covidxray.errors import UserError
from covidxray.run_folder import EVALUATION, EXPORT_REPORT, Versioned, read_versioned, write_json
from covidxray.strict import ConfigError, from_dict

EVALUATION_VERSION = 1  # EVALUATION's layout: a reader refuses any other
EXPORT_REPORT_VERSION = 1  # EXPORT_REPORT's layout: a reader refuses any other

Report = TypeVar("Report")


@dataclass(frozen=True)
class Rates:
    """One-vs-rest counts and rates of one class's calls (covidxray/train/metrics.py binary_rates); a rate is None
    when its denominator is 0."""

    sensitivity: float | None
    specificity: float | None
    ppv: float | None
    tp: int
    fp: int
    fn: int
    tn: int


@dataclass(frozen=True)
class OperatingPoint(Rates):
    """The rates at a class's threshold chosen on the val split."""

    threshold: float


@dataclass(frozen=True)
class ClassMetrics:
    support: int
    roc_auc: float | None  # None when the images lack this class or its complement
    argmax: Rates
    operating_point: OperatingPoint | None  # None when val gave the class no threshold


@dataclass(frozen=True)
class Classification:
    """The metrics of one set of images (covidxray/train/evaluate.py classification_report)."""

    images: int
    accuracy: float | None
    macro_roc_auc: float | None
    labels: list[str]
    confusion_matrix: list[list[int]]  # rows: true class, columns: predicted
    per_class: dict[str, ClassMetrics]


@dataclass(frozen=True)
class SourceMetrics(Classification):
    """One source's images of a set: a class recognised only across sources may be the source, not the disease."""

    classes: dict[str, int]
    ece: float
    train_images: int
    unseen: bool  # the training split holds no image of this source


@dataclass(frozen=True)
class ReliabilityBin:
    low: float
    high: float
    count: int
    accuracy: float | None  # None in an empty bin
    confidence: float | None


@dataclass(frozen=True)
class Calibration:
    ece: float
    classwise_ece: float
    bins: int
    binning: str  # how ece and classwise_ece are computed, in words
    reliability: list[ReliabilityBin]


@dataclass(frozen=True)
class Thresholds:
    chosen_on: str
    rule: str
    val_images: int
    per_class: dict[str, float | None]


@dataclass(frozen=True)
class ModelEntry:
    file: str
    architecture: str | None
    best_epoch: int | None


@dataclass(frozen=True)
class ExternalReport(Classification):
    """An external data set's images that are no copies of training images or patients (covidxray/train/external.py)."""

    data_dir: str
    images_prepared: int
    classes: dict[str, int]
    untrained_classes: dict[str, int]  # external images of a class the model never trained on
    dropped_as_copies: int
    dropped_by_kind: dict[str, int]
    dropped_unchecked: int
    copies_table: str
    copies: list[dict[str, str]]
    dropped_record_ids: list[str]
    ece: float
    per_source: dict[str, SourceMetrics]


@dataclass(frozen=True)
class EvaluationReport(Classification):
    """EVALUATION: the test split's metrics at thresholds chosen on val, and each external set's."""

    calibration: Calibration
    per_source: dict[str, SourceMetrics]
    split: str
    thresholds: Thresholds
    model: ModelEntry
    data_dir: str
    data_is_training_data: bool
    external: list[ExternalReport] = field(default_factory=list)
    # A report without the field was written before it existed, in this same layout: version 1.
    version: int = EVALUATION_VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KerasEntry:
    file: str
    bytes: int
    accuracy: float  # on the test split: every format's reference


@dataclass(frozen=True)
class FormatEntry:
    """One exported format measured against Keras on the test split, through LiteRT, with its fitted gates."""

    file: str
    agreement: float
    accuracy: float
    accuracy_delta: float
    temperature: float
    val_ece_before_after: list[float]
    ood_threshold: float
    test_over_ood_threshold: float
    layout_threshold: float
    test_over_layout_threshold: float
    test_not_upright: float
    bytes: int
    # What a format's registered extras and conversion add (covidxray/export/formats.py Exporter.extras,
    # .quantize): int8's agreement bar, C array (or why there is none) and method (ptq, qat or mixed), a
    # fine-tuned format's fine-tune seconds, the layers a mixed build keeps in float. A format whose extras add
    # another entry declares it here.
    meets_bar: bool | None = None
    c_array: list[str] | None = None
    c_array_note: str | None = None
    method: str | None = None
    fine_tune_s: float | None = None
    float_layers: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry as written: an extra only for the formats that have it."""
        extras = ("meets_bar", "c_array", "c_array_note", "method", "fine_tune_s", "float_layers")
        return {k: v for k, v in dataclasses.asdict(self).items() if not (k in extras and v is None)}


@dataclass(frozen=True)
class ExportReport:
    """EXPORT_REPORT. On disk each format's entry is a top-level key named by the format (`#/int8/agreement`)."""

    keras: KerasEntry
    saved_model: str
    test_images: int
    dataset_id: str
    data_is_training_data: bool
    int8_min_agreement: float
    formats: dict[str, FormatEntry]
    # A report without the field was written before it existed, in this same layout: version 1.
    version: int = EXPORT_REPORT_VERSION

    def to_json(self) -> dict[str, Any]:
        top = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("formats", "version")}
        formats = {fmt: entry.to_json() for fmt, entry in self.formats.items()}
        return {**top, **formats, "version": self.version}


def evaluation_report(content: dict[str, Any], where: str = EVALUATION) -> EvaluationReport:
    """The EvaluationReport in `content` (EVALUATION's JSON); ConfigError naming the key under `where`."""
    return from_dict(EvaluationReport, content, where)


def export_report(content: dict[str, Any], where: str = EXPORT_REPORT) -> ExportReport:
    """The ExportReport in `content` (EXPORT_REPORT's JSON): every key that is not a field of ExportReport is a
    format's entry; ConfigError naming the key under `where`."""
    own = {f.name for f in dataclasses.fields(ExportReport)} - {"formats"}
    formats = {str(k): v for k, v in content.items() if k not in own}
    report = from_dict(ExportReport, {**{k: v for k, v in content.items() if k in own}, "formats": {}}, where)
    entries = {}
    for fmt, entry in formats.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}.{fmt}: expected a format's entry (a mapping), got {entry!r}")
        entries[fmt] = from_dict(FormatEntry, entry, f"{where}.{fmt}")
    return dataclasses.replace(report, formats=entries)


def write_evaluation_report(run_dir: Path, report: EvaluationReport) -> None:
    write_json(Path(run_dir) / EVALUATION, report.to_json())


def write_export_report(run_dir: Path, report: ExportReport) -> None:
    write_json(Path(run_dir) / EXPORT_REPORT, report.to_json())


def read_evaluation_report(run_dir: Path) -> EvaluationReport:
    """EVALUATION of `run_dir`; UserError when there is none, it is damaged or of another version."""
    return _read(Path(run_dir), EVALUATION, evaluation_report, "an evaluation report", EVALUATION_VERSION, "evaluate")


def read_export_report(run_dir: Path) -> ExportReport:
    """EXPORT_REPORT of `run_dir`; UserError when there is none, it is damaged or of another version."""
    return _read(Path(run_dir), EXPORT_REPORT, export_report, "an export report", EXPORT_REPORT_VERSION, "export")


def _read(
    run_dir: Path, name: str, parse: Callable[[dict[str, Any], str], Report], kind: str, current: int, command: str
) -> Report:
    path, command_line = run_dir / name, f"covidxray {command} --run-dir {run_dir}"
    if not path.is_file():
        raise UserError(f"{path} does not exist: run `{command_line}`")
    other_version = Versioned(kind, current, f"run `{command_line}` again with this covidxray")
    return read_versioned(path, parse, other_version, f"run `{command_line}` again")
