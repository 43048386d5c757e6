"""Issue 16: the edge install (`pip install covidxray[edge]`, no `train` extra) classifies, and every other
command says it needs the training install instead of ending in an ImportError traceback.

The edge install is simulated by running the CLI in a subprocess whose imports of the training-only
packages fail, as they would where those packages are absent; which packages those are is read from
pyproject.toml's `train` extra, independently of covidxray.train_stack.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions

import pytest
from conftest import REPO
from test_predict import check_schema, held_out_images

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def train_only_modules() -> set[str]:
    """Top-level modules installed by the `train` extra's distributions, plus Keras and Horovod (which come
    with TensorFlow / install.sh). Derived from the installed distributions, not from covidxray's code."""
    # The `train` extra also narrows some base packages to their numpy-1 releases (numpy, OpenCV, pylibjpeg):
    # those are the edge install's too.
    base = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    train = {requirement_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["train"]} - base
    modules = {
        module
        for module, dists in packages_distributions().items()
        if any(d.lower().replace("_", "-") in train for d in dists)
    }
    return modules | {"keras", "tf_keras", "horovod"}


BLOCKER = """
import sys
BLOCKED = set(sys.argv.pop(1).split(','))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
sys.meta_path.insert(0, Absent())
from covidxray.cli import app
app(args=sys.argv[1:], prog_name='covidxray')
"""


def run_on_edge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER, ",".join(sorted(train_only_modules())), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_base_dependencies_are_the_light_set():
    base = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = PYPROJECT["project"]["optional-dependencies"]
    heavy = {"tensorflow", "tensorflow-cpu", "scikit-learn", "albumentations", "kaggle", "matplotlib", "horovod"}
    assert not base & heavy
    assert {
        "ai-edge-litert",
        "opencv-python-headless",
        "numpy",
        "pydicom",
        "pylibjpeg",
        "pylibjpeg-libjpeg",
        "pylibjpeg-openjpeg",
        "pylibjpeg-rle",
    } <= base
    assert "edge" in extras and heavy - {"horovod"} <= {requirement_name(r) for r in extras["train"]}
    install_sh = (REPO / "scripts" / "install.sh").read_text()
    assert '-e ".[train,dev,serve]"' in install_sh  # serve: the web packages its tests need


def test_the_blocker_really_hides_the_train_stack():
    """Guard for the tests below: without it they would pass on a full install for the wrong reason."""
    assert {"tensorflow", "sklearn", "matplotlib", "albumentations"} <= train_only_modules()
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER.split("from covidxray")[0] + "import tensorflow",
            ",".join(train_only_modules()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode != 0 and "No module named 'tensorflow'" in probe.stderr


def test_predict_works_without_the_train_stack(exported_run, synthetic_data, shared_data):
    """A phantom PNG, a real chest PNG and a real JPEG 2000 DICOM (decoded through the pylibjpeg plugins)."""
    real_png = next(iter(sorted((shared_data / "covid19-talo-sample").rglob("*.png"))))
    real_dicom = shared_data / "dicom" / "DX-MONO1-12bit-INVERSE-j2k-966_fixed.dcm"
    files = [str(held_out_images(synthetic_data, 1)[0]), str(real_png), str(real_dicom)]
    result = run_on_edge("predict", "--model", str(exported_run), "--json", *files)
    document = json.loads(result.stdout)
    check_schema(document)
    assert [entry["file"] for entry in document] == files and not any("error" in entry for entry in document), (
        result.stderr[-2000:]
    )
    assert "label" in document[0]  # the phantom is what the model was trained on
    # The model saw only phantoms, so its out-of-distribution gate may refuse the real radiographs: that is a
    # decoded image and predict's answer (exit 1), not a failure of the edge install.
    rejected = [entry for entry in document if "rejected" in entry]
    assert all(entry["reason"] == "out-of-distribution" for entry in rejected)
    assert result.returncode == (1 if rejected else 0), result.stderr[-2000:]


TRAINING_COMMANDS = {
    "prepare": ["prepare", "--source", "synthetic", "--data-dir", "{tmp}/data"],
    "train": ["train", "--epochs", "1", "--data-dir", "{data}", "--run-dir", "{tmp}/run"],
    "evaluate": ["evaluate", "--data-dir", "{data}", "--run-dir", "{run}"],
    "export": ["export", "--format", "int8", "--data-dir", "{data}", "--run-dir", "{run}"],
    "demo": ["demo", "--epochs", "1", "--workdir", "{tmp}/demo"],
    "report": ["report", "{run}", "--out", "{tmp}/report.html"],
    "doctor": ["doctor"],
}


@pytest.mark.parametrize("command", sorted(TRAINING_COMMANDS))
def test_training_commands_name_the_install_they_need(command, exported_run, synthetic_data, tmp_path):
    args = [a.format(tmp=tmp_path, data=synthetic_data, run=exported_run) for a in TRAINING_COMMANDS[command]]
    result = run_on_edge(*args)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "training install" in message and "scripts/install.sh" in message and "covidxray[train]" in message
    assert not (tmp_path / "data").exists() and not (tmp_path / "demo" / "data" / "manifest.json").exists()


def test_predict_explain_says_it_needs_tensorflow(exported_run, synthetic_data, tmp_path):
    """Grad-CAM runs the Keras model: on an edge install, a message instead of a traceback or a silent skip."""
    image = str(held_out_images(synthetic_data, 1)[0])
    result = run_on_edge(
        "predict", "--model", str(exported_run), "--explain", "--explain-dir", str(tmp_path / "gc"), image
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "needs TensorFlow" in " ".join(result.stderr.split())
    assert not (tmp_path / "gc").exists()


def test_prepare_on_an_install_without_tensorflow_names_the_train_extra_whole(tmp_path):
    """Where TensorFlow is simply not installed, prepare's early check finds no module (find_spec: None) rather than
    an import failing; its message still reaches the user whole, `covidxray[train]` not eaten as rich markup."""
    absent = (
        "import importlib.util, sys\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'tensorflow' else find(name, *a)\n"
        "from covidxray.cli import app\n"
        "app(args=sys.argv[1:], prog_name='covidxray')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", absent, "prepare", "--source", "synthetic", "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "needs TensorFlow" in message and "pip install 'covidxray[train]'" in message
    assert not (tmp_path / "data").exists()
