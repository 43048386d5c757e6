"""The page as a person uses it: Debian's headless chromium, driven by selenium through Debian's chromedriver
(no browser download), opens `covidxray serve`, chooses files and reads what the page shows.

The model: a mobilenet_v3_small trained briefly on the phantom set and exported, so it has class maps and the
page draws the Grad-CAM overlay. A model trained on phantoms refuses most real films (its gate was fitted on
phantoms), so for the real PNG and DICOM of ../shared/data the page must show exactly what
`covidxray predict --json` says, class or refusal; with COVIDXRAY_SERVE_REAL_MODEL naming a .tflite exported from
real films (and class maps), the page must show a class and the overlay for them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import cv2
import pytest
from conftest import SHARED_DATA, run_cli
from serving import start_server, stop_server
from test_predict import held_out_images

pytest.importorskip("flask")
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
REAL_MODEL = os.environ.get("COVIDXRAY_SERVE_REAL_MODEL")

pytestmark = pytest.mark.slow  # a model trained and exported, a browser started


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def pooling_run(synthetic_data, tmp_path_factory) -> Path:
    """mobilenet_v3_small (global average pooling head, so class maps) trained 2 epochs on the phantoms, exported."""
    run_dir = tmp_path_factory.mktemp("pooling") / "run"
    trained = run_cli(
        "train", "--data-dir", str(synthetic_data), "--run-dir", str(run_dir), "--model", "mobilenet_v3_small",
        "--epochs", "2",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run_cli("export", "--run-dir", str(run_dir), "--data-dir", str(synthetic_data), "--format", "float32")
    assert exported.returncode == 0, exported.stderr[-3000:]
    return run_dir / "model-float32.tflite"


def shown(driver, path: Path) -> dict:
    """Choose `path` in the page's file input; what the page then shows."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, "status").get_attribute("id")  # the page is loaded
    driver.find_element(By.ID, "file").send_keys(str(path))
    WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "status").text == "done")

    def visible_text(element_id: str) -> str | None:
        element = driver.find_element(By.ID, element_id)
        return element.text if element.is_displayed() else None

    overlay = driver.find_element(By.ID, "overlay")
    painted = driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", overlay)
    return {
        "label": visible_text("label"),
        "probabilities": visible_text("probabilities"),
        "overlay_width": painted if overlay.is_displayed() else 0,
        "rejected": visible_text("rejected"),
        "error": visible_text("error"),
    }


def open_page(driver, url: str) -> None:
    driver.get(url)
    assert "Not a diagnosis" in driver.page_source


def predicted(model: Path, path: Path) -> dict:
    result = run_cli("predict", "--json", "--model", str(model), str(path))
    return json.loads(result.stdout)[0]


def assert_page_shows(page: dict, oracle: dict, overlay_size: tuple[int, int]) -> None:
    """The page shows predict's answer: the class with every probability and the overlay, or the refusal, or the error."""
    if "label" in oracle:
        assert page["label"] == oracle["label"]
        for name, probability in oracle["probabilities"].items():
            assert f"{name} {100 * probability:.1f} %" in page["probabilities"]
        width, longest = overlay_size[0], max(overlay_size)
        assert page["overlay_width"] == (width if longest <= 1024 else round(width * 1024 / longest))
    elif "rejected" in oracle:
        assert page["label"] is None and oracle["reason"] in page["rejected"] and page["overlay_width"] == 0
    else:
        assert page["label"] is None and oracle["error"] in page["error"]


def image_size(path: Path) -> tuple[int, int]:
    from covidxray.edge.preprocess import load_gray

    gray = load_gray(path)
    return gray.shape[1], gray.shape[0]


def test_the_page_shows_class_overlay_and_refusals_as_predict_does(browser, pooling_run, synthetic_data, tmp_path):
    from skimage import data

    server = start_server(pooling_run, tmp_path / "serve.log")
    try:
        open_page(browser, server.url)
        # a held-out film the briefly trained model classifies (its gate may refuse a few): class and overlay
        phantom, oracle = classified_phantom(pooling_run, synthetic_data)
        page = shown(browser, phantom)
        assert page["label"] and page["overlay_width"] > 0
        assert_page_shows(page, oracle, image_size(phantom))

        cv2.imwrite(str(tmp_path / "camera.png"), data.camera())  # a gray photo: the radiograph gate refuses it
        cv2.imwrite(str(tmp_path / "astronaut.png"), cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR))
        for photo in (tmp_path / "camera.png", tmp_path / "astronaut.png"):
            page = shown(browser, photo)
            oracle = predicted(pooling_run, photo)
            assert "label" not in oracle and page["label"] is None and page["overlay_width"] == 0
            assert_page_shows(page, oracle, (0, 0))
        assert shown(browser, tmp_path / "camera.png")["rejected"].startswith("camera.png: not a chest radiograph")

        if SHARED_DATA.is_dir():
            for real in real_png_and_dicom(tmp_path):
                assert_page_shows(shown(browser, real), predicted(pooling_run, real), image_size(real))
    finally:
        output = stop_server(server)
    assert "Traceback" not in output


def classified_phantom(model: Path, synthetic_data: Path) -> tuple[Path, dict]:
    films = held_out_images(synthetic_data, 12)
    answers = json.loads(run_cli("predict", "--json", "--model", str(model), *map(str, films)).stdout)
    return next((film, answer) for film, answer in zip(films, answers) if "label" in answer)


def real_png_and_dicom(tmp_path: Path) -> list[Path]:
    """A real PNG film and a real chest DICOM of ../shared/data (copied: the browser uploads a file by path)."""
    png = sorted(SHARED_DATA.glob("covid-chestxray-sample/**/*.png"))[0]
    dicom = SHARED_DATA / "dicom" / "CR-MONO2-8bit-rsna.dcm"
    return [Path(shutil.copy(path, tmp_path / path.name)) for path in (png, dicom)]


@pytest.mark.skipif(not REAL_MODEL, reason="COVIDXRAY_SERVE_REAL_MODEL (a .tflite exported from real films) not set")
def test_real_films_get_a_class_and_the_overlay_with_a_real_model(browser, shared_data, tmp_path):
    model = Path(REAL_MODEL or "")
    server = start_server(model, tmp_path / "serve.log")
    try:
        open_page(browser, server.url)
        for real in real_png_and_dicom(tmp_path):
            page = shown(browser, real)
            oracle = predicted(model, real)
            assert "label" in oracle, oracle  # this model's gate takes real films
            assert page["overlay_width"] > 0
            assert_page_shows(page, oracle, image_size(real))
    finally:
        output = stop_server(server)
    assert "Traceback" not in output
