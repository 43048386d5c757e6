"""Layered configuration: dataclass defaults -> YAML file -> CLI overrides.

Unknown keys are errors (a typo must not silently train with a default), and
the resolved config is written beside every checkpoint and model so that a
model directory is self-describing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from covidxray.edge.harmonise import METHODS as HARMONISE_METHODS
from covidxray.edge.harmonise import NONE as HARMONISE_NONE
from covidxray.edge.image_header import DEFAULT_MAX_PIXELS
from covidxray.files import atomic_write
from covidxray.records import HARMONISED_LABELS
from covidxray.strict import ConfigError, from_dict, setting
from covidxray.urls import redacted


@dataclass
class DataConfig:
    # Source name -> that source's options (see `covidxray sources`); `from_path` points at
    # an archive or folder already on disk instead of downloading.
    sources: dict[str, dict[str, Any]] = field(default_factory=lambda: {"synthetic": {}})
    data_dir: str = "data/prepared"  # shards + manifest.json; one folder per prepared data set
    task: str = "chest3"
    image_size: int = setting(128, low=16, high=2048)
    val_fraction: float = setting(0.15, low=0.0, high=0.9)
    test_fraction: float = setting(0.15, low=0.0, high=0.9)
    # patient: every source split by patient (val/test fractions); source: each source's own train/test
    # folders kept (val carved from its train by patient). Either way no patient is in two splits.
    split: str = setting("patient", choices=("patient", "source"))
    holdout_source: str = ""  # a source name: all its images are the test split, the others train/val only
    records_per_shard: int = setting(256, low=1)
    workers: int = setting(0, low=0)  # 0: one per core
    # Perceptual (256-bit hash) Hamming distance counted as a duplicate; -1: exact duplicates only.
    dedup_max_distance: int = setting(12, low=-1, high=32)
    # Warn when one source supplies at least this share of a class's images (a shortcut a model can learn).
    shortcut_warning_share: float = setting(0.8, above=0.5, high=1.0)
    # Geometric near-duplicate check (crops, borders, rotations, flips): RANSAC inliers that confirm a copy; 0: off.
    dedup_min_inliers: int = setting(32, low=0, high=384)
    # Copies of one image with different labels: drop (all copies) or keep_priority (the preferred source's copy).
    dedup_label_conflicts: str = setting("drop", choices=("drop", "keep_priority"))
    seed: int = setting(0, low=0, high=2**31 - 1)
    # Source finding -> harmonised label, for findings the descriptors leave unmapped (prepare lists
    # them with the exact line to add here) or map differently; wins over every descriptor.
    label_overrides: dict[str, str] = setting(default_factory=dict, choices=HARMONISED_LABELS)
    # Images declaring more pixels are refused before decoding (prepare and predict); the default fits one
    # decode worker per core on a 4 GB board (arithmetic in covidxray/edge/image_header.py).
    max_pixels: int = setting(DEFAULT_MAX_PIXELS, low=256)
    # Seconds one file may take to decode (prepare, audit); past it its worker is killed, the file retried once
    # alone, then dropped as decode-timeout (a crafted file can send a decoder into an endless loop). 0: no limit.
    # A 3520x4280 12-bit JPEG 2000 CR decodes in 2-3 s on a busy x86 core, so ~20-30 s on a Pi 4: 300 s leaves
    # ~10x for a larger or slower file. With workers 1 decoding runs in prepare's own process: only named, not stopped.
    decode_timeout_s: float = setting(300.0, low=0.0)
    # Archive extraction stops with an error beyond this many bytes in total, or when the archive would
    # expand to more than max_compression_ratio x its own size (zip bombs); real collections are ~1-10 GB of JPEG/PNG.
    # A zip bomb (a 9.7 MB zip holding a 2 GiB member) is ~220x; JPEG/PNG collections ~1x, CSVs ~10x.
    max_extract_bytes: int = setting(64 << 30, low=1)
    max_compression_ratio: float = setting(100.0, above=1.0)
    # Pixels made alike across collections before the resize (covidxray/edge/harmonise.py): none, or
    # trim-inpaint-equalise (frame trimmed, burnt-in text and markers inpainted, histogram equalised + CLAHE).
    # The manifest, model card and sidecar carry it, and predict applies the same to every image.
    harmonise: str = setting(HARMONISE_NONE, choices=HARMONISE_METHODS)

    def recorded(self) -> dict[str, Any]:
        """The values as manifests and saved configs keep them: a password in a source's `url` hidden."""
        values = dataclasses.asdict(self)
        values["sources"] = {
            name: {key: redacted(v) if key == "url" and isinstance(v, str) else v for key, v in options.items()}
            for name, options in values["sources"].items()
        }
        return values


@dataclass
class TrainConfig:
    model: str = "small_cnn"
    weights: str = ""  # Keras applications: "" (random), imagenet (Keras download + cache) or a local backbone file
    run_dir: str = "runs/default"
    epochs: int = setting(10, low=1)
    batch_size: int = setting(32, low=1)  # per rank
    learning_rate: float = setting(1e-3, above=0.0, high=10.0)  # for one rank; scaled by the number of ranks
    warmup_epochs: int = setting(1, low=0)  # linear LR ramp from ~0 to the peak, then `lr_schedule`
    lr_schedule: str = setting("cosine", choices=("cosine", "constant"))  # after warmup: cosine decay to 0, or flat
    label_smoothing: float = setting(0.1, low=0.0, high=0.5)  # targets 1 - s + s/classes and s/classes
    # Training images (over all ranks) whose batch statistics replace the BN moving averages before each
    # validation; 0 keeps Keras' moving averages (which lag far behind in short runs).
    bn_recalibration_images: int = setting(1024, low=0)
    # BN layers in inference mode throughout: their statistics are measured once on bn_recalibration_images
    # training images before the first epoch, then fixed (no per-epoch re-estimation). For fine-tuning a pretrained
    # backbone with small per-rank batches.
    freeze_batchnorm: bool = False
    # The backbone's first N stages keep their pretrained weights (efficientnet_lite0: 0 the stem, 1-7 its MBConv
    # stages, 8 the head); less to fit, and no backprop through the high-resolution layers (memory, time per step).
    # 9 (all of them) trains the classifier alone, a linear model of the ImageNet features (on 300 films: level with
    # the other recipes, docs/benchmarks.md 6d).
    frozen_stages: int = setting(0, low=0, high=9)
    augment: bool = True
    # Scales every augmentation range (train/input.py): 1 = +-8% scale, +-4% shift, +-7 deg, +-12% brightness/contrast.
    augment_strength: float = setting(1.0, above=0.0, high=3.0)
    class_weights: bool = True
    class_weight_power: float = setting(
        1.0, low=0.0, high=1.0
    )  # weight ~ count^-power: 1 inverse frequency, 0.5 square root
    shuffle_buffer: int = setting(512, low=1)
    # Issue 24, less learning of the source (docs/datasets.md, "Source bias"): by_source draws every batch from
    # every source in proportion, with class weights computed within each source (train/source_balance.py);
    # degrade: probability of each encoding degradation (lower resolution, JPEG, noise) in augmentation;
    # source_adversary: weight of a source-adversarial head behind a gradient reversal (train/source_adversary.py), 0: none.
    sampling: str = setting("shuffle", choices=("shuffle", "by_source"))
    degrade: float = setting(0.0, low=0.0, high=1.0)
    source_adversary: float = setting(0.0, low=0.0, high=10.0)
    early_stopping_patience: int = setting(0, low=0)  # epochs without val AUC gain; 0 disables
    # Rank 0 writes TensorBoard event files to <run_dir>/tensorboard, one point per epoch (global step = epoch):
    # losses, validation metrics, learning rate, images/s per rank, the validation confusion matrix.
    tensorboard: bool = True
    elastic: bool = False  # launched by horovodrun --min-np/--max-np/--host-discovery-script
    # Horovod, set before hvd.init() (docs/training.md): gradients on the wire as float16 halve the bytes per step;
    # the tensor-fusion buffer (MiB, 0: no fusion) and the background thread's cycle (ms) override horovodrun's flags.
    gradient_compression: str = setting("none", choices=("none", "fp16"))
    fusion_buffer_mb: int = setting(128, low=0, high=1024)
    cycle_time_ms: float = setting(1.0, above=0.0, high=1000.0)
    seed: int = setting(0, low=0, high=2**31 - 1)


@dataclass
class ExportConfig:
    formats: list[str] = field(default_factory=lambda: ["float32"])
    int8_min_agreement: float = setting(0.98, low=0.0, high=1.0)
    representative_samples: int = setting(200, low=1)
    # int8 from the float model as it is (ptq: post-training, calibrated on representative_samples train films),
    # after a short quantization-aware fine-tune toward the float model's own probabilities (qat:
    # covidxray/export/qat.py; int8_qat_steps batches of 16 train films at int8_qat_learning_rate), or as ptq with
    # the int8_float_layers layers whose int8 output errs most on the calibration films kept in float (mixed:
    # covidxray/export/mixed_int8.py; not integer-only, so no C array for TensorFlow Lite Micro).
    int8_method: str = setting("ptq", choices=("ptq", "qat", "mixed"))
    int8_qat_steps: int = setting(200, low=1, high=100_000)
    int8_qat_learning_rate: float = setting(3e-6, above=0.0, high=0.01)
    # 2: on the Pi-cluster model two layers err about 3 quantization steps (rms), every other one 0.55 or less.
    int8_float_layers: int = setting(2, low=1, high=1000)
    # Out-of-distribution threshold = the largest val-split distance x this (covidxray/edge/ood.py).
    ood_margin: float = setting(2.0, above=0.0, high=100.0)
    # Chest-layout threshold = the largest val-split layout score x this (covidxray/edge/chest_layout.py).
    # 1.7: at 1.2, adult films of collections not in training (NIH, ieee8023) reached 1.68 x the val maximum
    # (docs/deploy.md); photos that a wider limit lets through are refused by the orientation check.
    layout_margin: float = setting(1.7, above=0.0, high=100.0)
    # Source-profile limit = a training source's largest val-split distance x this; predict warns (never rejects)
    # when an image is beyond every source's limit (covidxray/edge/source_profile.py).
    source_margin: float = setting(1.0, above=0.0, high=100.0)


@dataclass
class ServeConfig:
    """`covidxray serve` (covidxray/serve): its image limits are data.max_pixels, as for predict."""

    # An upload above this many MiB is refused from its Content-Length, before its body is read; 64 MiB holds
    # an uncompressed 16-bit DICOM of data.max_pixels' 16 M pixels (32 MiB) twice over.
    max_upload_mb: float = setting(64.0, above=0.0, high=4096.0)
    # Inference threads, each with its own LiteRT interpreter (one is not thread-safe); 0: one per core.
    workers: int = setting(0, low=0, high=64)
    # Uploads waiting for a worker; one more gets 503 and Retry-After instead of an unbounded wait.
    queue: int = setting(16, low=0, high=1024)
    # Seconds one upload may take to decode and classify; past it the client gets 422 and the answer is dropped
    # (a thread cannot be stopped: the pixel limit, checked before decoding, is what bounds the work itself).
    decode_timeout_s: float = setting(30.0, above=0.0, high=3600.0)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "data": self.data.recorded()}

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "sources":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(text: str, where: str) -> Any:
    """YAML in safe mode: plain data only, so a tag such as !!python/object/apply is refused, never run."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None


def parse_override(text: str) -> dict[str, Any]:
    """`train.epochs=3` -> {"train": {"epochs": 3}}; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. train.epochs=3")
    value = _read_yaml(raw, f"--set {key.strip()}") if raw.strip() else ""
    nested: Any = value  # the innermost value is any YAML scalar or collection; each level wraps it in a mapping
    for part in reversed(key.strip().split(".")):
        nested = {part: nested}
    return nested


def load_config(
    path: str | Path | None = None,
    overrides: list[dict[str, Any]] | None = None,
) -> Config:
    """Resolve defaults, then the YAML file at `path`, then each override in order."""
    values: dict[str, Any] = {}
    if path:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; give the YAML file itself (see configs/)")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as err:
            raise ConfigError(f"cannot read config file {path} ({err.strerror or err})") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path} is not a text (UTF-8) YAML file: byte {err.start} is 0x{err.object[err.start]:02x}; "
                "give the YAML config itself (see configs/)"
            ) from None
        loaded = _read_yaml(text, str(path)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping with data/train/export sections")
        values = loaded
    for override in overrides or []:
        values = _merge(values, override)
    where = str(path) if path else "config"
    config = from_dict(Config, values, where)
    if config.data.val_fraction + config.data.test_fraction >= 1:
        raise ConfigError(
            f"{where}.data: val_fraction ({config.data.val_fraction}) + test_fraction ({config.data.test_fraction}) "
            "must be below 1, or nothing is left to train on"
        )
    return config
