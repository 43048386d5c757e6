"""One registry for sources, models, tasks and export formats: refuses duplicates, lists, and is what the CLI shows."""

from __future__ import annotations

import pytest
from conftest import run_cli

from covidxray.data.labels import TASKS, Task, get_task, register_task
from covidxray.errors import UserError
from covidxray.export.formats import FORMATS
from covidxray.registry import Registry
from covidxray.sources import SOURCE_REGISTRY
from covidxray.sources.base import register_source
from covidxray.sources.synthetic import SyntheticSource
from covidxray.train.models import MODEL_REGISTRY, build_model, register_model


def test_a_duplicate_name_is_refused_and_the_first_entry_kept():
    registry: Registry[int] = Registry("widget")
    registry.add("a", 1, "the first")
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        registry.add("a", 2, "the second")
    assert registry.get("a") == 1 and registry.names() == ["a"]


@pytest.mark.parametrize(
    "register",
    [
        lambda: register_model("small_cnn")(lambda size, classes, weights="": None),
        lambda: register_task(Task("chest3", ("a",), {"normal": "a"}), "again"),
        lambda: register_source(type("Again", (SyntheticSource,), {"name": "synthetic"})),
    ],
)
def test_every_registry_refuses_a_name_it_already_has(register):
    before = {name: registry.get(name) for registry in (MODEL_REGISTRY, TASKS, SOURCE_REGISTRY) for name in registry}
    with pytest.raises(ValueError, match="registered twice"):
        register()
    assert {
        name: registry.get(name) for registry in (MODEL_REGISTRY, TASKS, SOURCE_REGISTRY) for name in registry
    } == before


def test_an_unknown_name_is_a_user_error_listing_the_known_ones():
    with pytest.raises(
        UserError,
        match=r"unknown model 'resnet'; available: efficientnet_b0, efficientnet_lite0, mobilenet_v3_small, small_cnn",
    ):
        build_model("resnet", 32, 2)
    with pytest.raises(UserError, match="unknown task 'xray9'; available: chest3, chest4, oct, pneumonia"):
        get_task("xray9")


@pytest.mark.parametrize(
    ("command", "registry"),
    [("sources", SOURCE_REGISTRY), ("models", MODEL_REGISTRY), ("tasks", TASKS), ("formats", FORMATS)],
)
def test_each_listing_command_prints_exactly_its_registry(command, registry):
    result = run_cli(command)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == registry.names()
    assert all(line.split(None, 1)[1] == registry.describe(line.split()[0]) for line in lines)


def test_cli_help_lists_the_registered_names():
    help_text = " ".join(run_cli("train", "--help").stdout.split())
    assert all(name in help_text for name in MODEL_REGISTRY)
    export_help = " ".join(run_cli("export", "--help").stdout.split())
    assert ", ".join(FORMATS.names()) in export_help


def test_a_registered_task_works_end_to_end_through_prepare(tmp_path, monkeypatch):
    from covidxray.config import load_config
    from covidxray.data.prepare import prepare

    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))  # the new task leaves with this test
    register_task(
        Task(
            "covid_vs_rest",
            ("other", "covid-19"),
            {"normal": "other", "pneumonia/bacterial": "other", "pneumonia/viral": "other", "covid-19": "covid-19"},
        ),
        "test task",
    )
    config = load_config(
        None,
        [
            {
                "data": {
                    "sources": {"synthetic": {"patients": 24}},
                    "task": "covid_vs_rest",
                    "data_dir": str(tmp_path / "data"),
                    "image_size": 32,
                    "dedup_min_inliers": 0,
                }
            }
        ],
    )
    manifest = prepare(config.data, log=lambda _message: None).to_json()
    assert manifest["task"] == "covid_vs_rest" and manifest["labels"] == ["other", "covid-19"]
    assert sum(manifest["splits"][split]["classes"]["covid-19"] for split in manifest["splits"]) > 0


def test_a_registered_model_is_built_by_name(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    monkeypatch.setattr(MODEL_REGISTRY, "_entries", dict(MODEL_REGISTRY._entries))

    @register_model("tiny_dense", "one Dense layer")
    def tiny(image_size, num_classes, weights=""):
        inputs = tf.keras.Input((image_size, image_size, 1))
        return tf.keras.Model(
            inputs, tf.keras.layers.Dense(num_classes, activation="softmax")(tf.keras.layers.Flatten()(inputs))
        )

    model = build_model("tiny_dense", 8, 3)
    assert model.output_shape == (None, 3) and model.count_params() == 8 * 8 * 3 + 3
