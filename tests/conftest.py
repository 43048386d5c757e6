"""Shared fixtures: one small prepared phantom set and one model trained on it per test session.

Built once and reused, because preparing and training dominate the suite's time
on a 2-core CI machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
VENV_BIN = Path(sys.executable).parent


def with_default_sigint() -> None:
    """Popen's preexec_fn for a child the test interrupts with SIGINT: a shell starts background jobs (a suite run
    with `&` or nohup) with SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def covidxray_cmd(*args: str) -> list[str]:
    """The installed console script, as a user would run it."""
    return [str(VENV_BIN / "covidxray"), *args]


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(covidxray_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory) -> Path:
    """A prepared phantom set: 64 px, small shards so two ranks get disjoint files."""
    from covidxray.config import load_config
    from covidxray.data.prepare import prepare

    data_dir = tmp_path_factory.mktemp("synthetic") / "data"
    config = load_config(
        None,
        [
            {
                "data": {
                    "sources": {"synthetic": {"patients": 400}},
                    "data_dir": str(data_dir),
                    "image_size": 64,
                    "records_per_shard": 64,
                }
            }
        ],
    )
    prepare(config.data)
    return data_dir


@pytest.fixture(scope="session")
def trained_run(synthetic_data, tmp_path_factory) -> Path:
    """A small CNN trained on `synthetic_data` in a separate process (as `covidxray train`)."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    result = run_cli("train", "--data-dir", str(synthetic_data), "--run-dir", str(run_dir), "--epochs", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def exported_run(trained_run, synthetic_data) -> Path:
    result = run_cli("export", "--run-dir", str(trained_run), "--data-dir", str(synthetic_data), "--format", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    return trained_run


def copy_trained_model(run_dir: Path, target: Path) -> Path:
    """What `covidxray train` leaves for export (model, card, config), in a fresh run folder."""
    target.mkdir(parents=True)
    for name in ("model.keras", "model.json", "config.yaml"):
        shutil.copy2(run_dir / name, target / name)
    return target


@pytest.fixture(scope="session")
def all_formats_run(trained_run, synthetic_data, tmp_path_factory) -> Path:
    """`trained_run`'s model exported to every registered format (float32, float16, int8) in its own folder."""
    run_dir = copy_trained_model(trained_run, tmp_path_factory.mktemp("all-formats") / "run")
    from covidxray.export.formats import FORMATS

    formats = [arg for fmt in FORMATS.names() for arg in ("--format", fmt)]
    result = run_cli("export", "--run-dir", str(run_dir), "--data-dir", str(synthetic_data), *formats)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Real samples beside the repo, when this checkout has them (never required by the product)."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    return SHARED_DATA


def kaggle_films(shared: Path, folder: str, count: int, size: int):
    """Every n-th film of a Kaggle folder (both classes), as the model reads them (float32)."""
    import numpy as np

    from covidxray.edge.preprocess import as_model_input, load_gray

    paths = sorted((shared / "chest-xray-pneumonia-224" / "chest_xray" / folder).rglob("*.jpeg"))
    step = len(paths) // count
    return np.stack([as_model_input(load_gray(path), size) for path in paths[::step][:count]]).astype(np.float32)


def near_tie_model(shared: Path, size: int, classes: int):
    """(served efficientnet_lite0 as export serves it, 96 train films, 128 test films, Keras' calls on the test
    films): ImageNet features under an untrained head give many near-ties between classes, where int8 rounding
    flips calls."""
    import tensorflow as tf

    from covidxray.export.class_maps import served_model
    from covidxray.export.input_scaling import fold_input_scaling
    from covidxray.train.models import build_model

    tf.keras.utils.set_random_seed(0)
    served = served_model(fold_input_scaling(build_model("efficientnet_lite0", size, classes, "imagenet")))
    train, test = kaggle_films(shared, "train", 96, size), kaggle_films(shared, "test", 128, size)
    return served, train, test, served.predict(test, verbose=0)[0].argmax(1)


def int8_argmax(flatbuffer: bytes, images):
    """The class an int8 build (uint8 pixels in) calls for each image, by TensorFlow's own interpreter."""
    import numpy as np
    import tensorflow as tf

    runner = tf.lite.Interpreter(model_content=flatbuffer).get_signature_runner()
    return np.array([runner(image=image[None].astype(np.uint8))["probabilities"][0].argmax() for image in images])


def have_horovod() -> bool:
    return shutil.which("horovodrun", path=str(VENV_BIN)) is not None


def write_rebound(source: Path, target: Path, card) -> Path:
    """`source`'s model beside the sidecar `card`, re-bound to it (tests/test_security_edge.py checks that an edit
    that is not re-bound is refused for that alone); a card that is not an object cannot be bound."""
    from covidxray.edge.model_binding import bind

    target.mkdir(parents=True, exist_ok=True)
    flatbuffer = source.read_bytes()
    if isinstance(card, dict):
        flatbuffer, card = bind(flatbuffer, card)
    (target / source.name).write_bytes(flatbuffer)
    (target / source.name).with_suffix(".json").write_text(json.dumps(card))
    return target / source.name
