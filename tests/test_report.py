"""Issue 29: `covidxray report`, checked against the files it reads and in a real browser (Debian's chromium)."""

from __future__ import annotations

import csv
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_cli

DATA_FILES = ("manifest.json", "dropped.csv", "duplicates.csv")
SECTION_IDS = ["data-card", "training", "evaluation", "exported-formats", "examples", "intended-use"]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


class Page(HTMLParser):
    """The parts of the report a test looks at: tagged figures and texts, sections, images, links, scripts."""

    def __init__(self, text: str):
        super().__init__()
        self.figures: list[dict] = []  # {"from", "format", "kind", "text"}
        self.sections: dict[str, str] = {}
        self.images: list[str] = []
        self.external: list[str] = []
        self.scripts = 0
        self.charts = 0
        self._open: dict | None = None
        self._section: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and attrs.get("class") in ("fig", "txt"):
            self._open = {
                "from": attrs["data-from"],
                "format": attrs.get("data-format"),
                "kind": attrs["class"],
                "text": "",
            }
        if tag == "section":
            self._section = attrs["id"]
            self.sections[self._section] = ""
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "script":
            self.scripts += 1
        if tag == "svg":
            self.charts += 1
        for name in ("src", "href"):
            if attrs.get(name) and not attrs[name].startswith(("data:", "#")):
                self.external.append(attrs[name])

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.figures.append(self._open)
            self._open = None
        if tag == "section":
            self._section = None

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data
        if self._section:
            self.sections[self._section] += data


def _load(path: Path):
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".yaml":
        return yaml.safe_load(path.read_text())
    if path.suffix == ".npz":
        with np.load(path) as saved:
            return {name: saved[name].tolist() for name in saved.files}
    raise AssertionError(f"figure from an unexpected file {path}")


def _walk(document, pointer: str):
    """RFC 6901, plus `*` for every item of a list (a list of values back)."""
    values = [document]
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if part == "*":
            values = [item for value in values for item in value]
        else:
            values = [value[int(part)] if isinstance(value, list) else value[part] for value in values]
    return values if "*" in pointer.split("/") else values[0]


def expected_value(source: str, run_dir: Path, data_dir: Path):
    """What the file named in a figure's data-from holds there (the oracle)."""
    operation, _, rest = source.partition(":")
    if operation == "scale":
        factor, _, rest = rest.partition(":")
        operation = f"scale {factor}"
    elif operation not in ("csv-count", "count", "sum"):
        operation, rest = "", source
    name, _, pointer = rest.partition("#")
    path = (data_dir if name in DATA_FILES else run_dir) / name
    if operation == "csv-count":
        column, _, value = pointer.partition("=")
        with open(path, newline="") as handle:
            return sum(1 for row in csv.DictReader(handle) if row[column] == value)
    try:
        found = _walk(_load(path), pointer)
    except KeyError:
        return None  # a key the file lacks: the page must say n/a, not a number
    if operation == "count":
        return len(found)
    if operation == "sum":
        return float(sum(found))
    if operation.startswith("scale"):
        return found * float(operation.split()[1])
    return found


def printed(value, fmt: str | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) or fmt is None:
        return str(value)
    return format(float(value), fmt)


def check_every_figure(page: Page, run_dir: Path, data_dir: Path) -> set[str]:
    """Every tagged number and text equals what its file holds; returns the sources checked."""
    assert page.figures
    for item in page.figures:
        value = expected_value(item["from"], run_dir, data_dir)
        want = printed(value, item["format"]) if item["kind"] == "fig" else str(value)
        assert item["text"] == want, (item, value)
    return {item["from"] for item in page.figures}


def render(html_path: Path, screenshot: Path) -> tuple[Page, bytes]:
    """The page as Debian's chromium (headless, via selenium) renders it: its text, sections and a screenshot."""
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip("Debian's chromium + chromium-driver not installed (scripts/install.sh installs them)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,900"):
        options.add_argument(argument)
    options.binary_location = str(CHROMIUM)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(html_path.resolve().as_uri())
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1200, min(height + 50, 8000))
        driver.save_screenshot(str(screenshot))
        shown = driver.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
        broken = driver.execute_script("return Array.from(document.images).filter(i => !i.naturalWidth).length")
        rendered = driver.page_source
    finally:
        driver.quit()
    assert shown == SECTION_IDS and broken == 0
    return Page(rendered), screenshot.read_bytes()


def assert_not_blank(screenshot: bytes) -> None:
    import cv2

    picture = cv2.imdecode(np.frombuffer(screenshot, np.uint8), cv2.IMREAD_GRAYSCALE)
    assert picture is not None and picture.shape[0] > 1000
    dark = (picture < 128).mean()
    assert 0.005 < dark < 0.5, dark  # text and figures on a white page, not an empty or black one


@pytest.fixture(scope="module")
def evaluated_run(exported_run, synthetic_data, tmp_path_factory) -> Path:
    """The session's exported phantom run, copied, evaluated (test_predictions.npz) and reported."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    shutil.copytree(exported_run, run_dir, ignore=shutil.ignore_patterns("checkpoints", "saved_model"))
    result = run_cli("evaluate", "--run-dir", str(run_dir), "--data-dir", str(synthetic_data))
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli("report", str(run_dir), "--data-dir", str(synthetic_data))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(run_dir / "report.html")
    return run_dir


def test_every_figure_of_the_report_equals_the_file_it_came_from(evaluated_run, synthetic_data):
    page = Page((evaluated_run / "report.html").read_text())
    sources = check_every_figure(page, evaluated_run, synthetic_data)
    evaluation = json.loads((evaluated_run / "evaluation.json").read_text())
    labels = evaluation["labels"]
    wanted = {
        "evaluation.json#/accuracy",
        "evaluation.json#/macro_roc_auc",
        "evaluation.json#/calibration/ece",
        "export_report.json#/float32/agreement",
        "model-float32.json#/temperature/value",
        "model-float32.json#/ood/threshold",
        "train_log.json#/world_size",
        "manifest.json#/splits/test/records",
        "config.yaml#/train/model",
        *(f"evaluation.json#/per_class/{c}/roc_auc" for c in labels),
        *(f"evaluation.json#/per_class/{c}/operating_point/threshold" for c in labels),
        *(f"manifest.json#/splits/train/classes/{c}" for c in labels),
    }
    assert wanted <= sources, wanted - sources
    assert "Missing" not in "".join(page.sections.values())
    assert page.scripts == 0 and not page.external  # self-contained: nothing fetched, nothing run
    assert all(src.startswith("data:image/png;base64,") for src in page.images)

    # The examples are the most confident errors (up to 3) and the most confident right call per class, worked
    # out here from evaluate's predictions.
    with np.load(evaluated_run / "test_predictions.npz") as saved:
        truth, probabilities = saved["labels"], saved["probabilities"]
    predicted, confidence = probabilities.argmax(1), probabilities.max(1)
    errors = sorted(np.flatnonzero(predicted != truth), key=lambda i: -confidence[i])[:3]
    right = [
        max(np.flatnonzero((truth == c) & (predicted == c)), key=lambda i: confidence[i])
        for c in range(len(labels))
        if ((truth == c) & (predicted == c)).any()
    ]
    shown = [int(f["from"].split("/")[2]) for f in page.figures if f["from"].startswith("test_predictions.npz")]
    assert shown == [int(i) for i in [*errors, *right]]
    assert len(page.images) == 2 * len(shown) + 3  # each example twice (image, Grad-CAM), ROC, confusion, reliability
    assert page.charts == 4  # the training curves, inline SVG


def test_missing_files_are_said_to_be_missing_and_nothing_is_made_up(evaluated_run, synthetic_data, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(evaluated_run, run_dir)
    for name in ("evaluation.json", "roc.png", "export_report.json", "report.html"):
        (run_dir / name).unlink()
    (run_dir / "test_predictions.npz").write_bytes(b"half a file")  # damaged: said so, never a traceback
    result = run_cli("report", str(run_dir), "--data-dir", str(synthetic_data), "--out", str(tmp_path / "damaged.html"))
    assert result.returncode == 0, result.stderr[-3000:]
    damaged = Page((tmp_path / "damaged.html").read_text())
    assert "test_predictions.npz could not be read" in damaged.sections["examples"]
    result = run_cli("report", str(run_dir), "--data-dir", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "--data-dir" in result.stderr and "Traceback" not in result.stderr

    empty_data = tmp_path / "data"
    empty_data.mkdir()
    result = run_cli("report", str(run_dir), "--data-dir", str(empty_data), "--out", str(tmp_path / "card.html"))
    assert result.returncode == 0, result.stderr[-3000:]
    page = Page((tmp_path / "card.html").read_text())
    for section in ("data-card", "evaluation", "exported-formats", "examples"):
        assert "Missing:" in page.sections[section], section
    assert "evaluation.json does not exist" in page.sections["evaluation"]
    assert "export_report.json does not exist" in page.sections["exported-formats"]
    assert not any(
        f["from"].startswith(("evaluation.json", "export_report.json", "manifest.json")) for f in page.figures
    )
    check_every_figure(page, run_dir, empty_data)  # what is still shown (training) is still right


def test_the_demo_run_and_a_real_run_render_in_chromium(evaluated_run, synthetic_data, tmp_path):
    page, screenshot = render(evaluated_run / "report.html", tmp_path / "demo.png")
    assert_not_blank(screenshot)
    assert [s for s in SECTION_IDS if page.sections.get(s, "").strip()] == SECTION_IDS
    assert "not a medical device" in page.sections["intended-use"]


@pytest.mark.slow
def test_a_real_kaggle_run_reports_and_renders(shared_data, tmp_path):
    """Prepare 120 Kaggle images, train 2 epochs, evaluate, export, report: every figure checked, rendered in chromium."""
    source = shared_data / "chest-xray-pneumonia-224" / "chest_xray"
    if not source.is_dir():
        pytest.skip("chest-xray-pneumonia-224 not in ../shared/data")
    subset = tmp_path / "kaggle" / "chest_xray"
    for split, count in (("train", 40), ("test", 20)):
        for folder in ("NORMAL", "PNEUMONIA"):
            (subset / split / folder).mkdir(parents=True)
            for image in sorted((source / split / folder).iterdir())[:count]:
                shutil.copy2(image, subset / split / folder / image.name)
    data, run = tmp_path / "data", tmp_path / "run"
    steps = [
        [
            "prepare",
            "--source",
            f"chest-xray-pneumonia={tmp_path / 'kaggle'}",
            "--data-dir",
            str(data),
            "--task",
            "pneumonia",
            "--image-size",
            "96",
            "--set",
            "data.split=source",
        ],
        ["train", "--data-dir", str(data), "--run-dir", str(run), "--epochs", "2", "--batch-size", "16"],
        ["evaluate", "--data-dir", str(data), "--run-dir", str(run)],
        ["export", "--data-dir", str(data), "--run-dir", str(run)],
        ["report", str(run)],  # the data folder from the run's config.yaml
    ]
    for step in steps:
        result = run_cli(*step)
        assert result.returncode == 0, (step, result.stderr[-3000:])
    page = Page((run / "report.html").read_text())
    sources = check_every_figure(page, run, data)
    assert "manifest.json#/sources/chest-xray-pneumonia/records_kept" in sources
    assert "children aged 1-5" in page.sections["data-card"]
    rendered, screenshot = render(run / "report.html", tmp_path / "kaggle.png")
    assert_not_blank(screenshot)
    assert "Missing" not in "".join(rendered.sections.values())


def _report_of(run_dir: Path, data_dir: Path, out: Path) -> Page:
    result = run_cli("report", str(run_dir), "--data-dir", str(data_dir), "--out", str(out))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return Page(out.read_text())


def _cited(page: Page, name: str) -> list[dict]:
    return [f for f in page.figures if f["from"].split("#")[0].split(":")[-1] == name]


def test_an_edited_manifest_is_missing_in_the_loaders_words(evaluated_run, synthetic_data, tmp_path):
    """The page reads manifest.json through open_prepared: an edit the checksum catches is not shown as data."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name in DATA_FILES:
        shutil.copy2(synthetic_data / name, data_dir / name)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    manifest["splits"]["test"]["records"] += 1  # by hand, not resealed
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    page = _report_of(evaluated_run, data_dir, tmp_path / "page.html")
    said = f"Missing: the data card (manifest.json of the prepared data). {data_dir / 'manifest.json'} was changed after prepare wrote it"
    assert said in " ".join(page.sections["data-card"].split())
    assert "was changed after prepare wrote it" in page.sections["intended-use"]
    assert "Missing:" in page.sections["examples"] and not _cited(page, "manifest.json")
    check_every_figure(page, evaluated_run, data_dir)  # the rest is still shown, and right


def test_a_model_card_of_another_version_is_missing_in_the_loaders_words(evaluated_run, synthetic_data, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(evaluated_run, run_dir)
    card = json.loads((run_dir / "model.json").read_text())
    (run_dir / "model.json").write_text(json.dumps({**card, "version": 2}))
    page = _report_of(run_dir, synthetic_data, tmp_path / "page.html")
    training = " ".join(page.sections["training"].split())
    assert (
        f"Missing: the model card (model.json: best epoch, labels). {run_dir / 'model.json'} is a model card of version 2, written by another version of covidxray"
        in training
    )
    assert "Missing:" in page.sections["examples"] and not _cited(page, "model.json")
    assert _cited(page, "train_log.json") and _cited(page, "manifest.json")
    check_every_figure(page, run_dir, synthetic_data)


def test_a_damaged_sidecar_is_missing_in_the_loaders_words(evaluated_run, synthetic_data, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(evaluated_run, run_dir)
    sidecar = run_dir / "model-float32.json"
    content = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**content, "temperature": {"value": -1.0}}))
    page = _report_of(run_dir, synthetic_data, tmp_path / "damaged.html")
    formats = " ".join(page.sections["exported-formats"].split())
    assert (
        f"Missing: the sidecar of float32 (model-float32.json). sidecar {sidecar} temperature must be an object with a positive value"
        in formats
    )
    assert not _cited(page, "model-float32.json") and _cited(page, "export_report.json")
    check_every_figure(page, run_dir, synthetic_data)
    sidecar.write_text(json.dumps({**content, "version": 2}))
    page = _report_of(run_dir, synthetic_data, tmp_path / "other.html")
    assert f"sidecar {sidecar} is of version 2, written by another version of covidxray" in " ".join(
        page.sections["exported-formats"].split()
    )
