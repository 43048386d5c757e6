"""Config layering: dataclass defaults -> YAML -> --set -> dedicated flags; unknown keys rejected."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_cli

from covidxray.config import Config, ConfigError, load_config, parse_override


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"epochs": 5, "batch_size": 8}, "data": {"image_size": 96}}))
    config = load_config(path, [parse_override("train.epochs=7"), {"train": {"batch_size": 4}}])
    assert (config.train.epochs, config.train.batch_size, config.data.image_size) == (7, 4, 96)
    assert config.train.learning_rate == Config().train.learning_rate


def test_unknown_key_is_rejected_with_its_place(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml.train: unknown key\(s\) epoch"):
        load_config(path)


def test_a_misspelt_int8_key_is_rejected_with_its_place():
    with pytest.raises(ConfigError, match=r"export: unknown key\(s\) int8_qat_step\b"):
        load_config(None, [parse_override("export.int8_qat_step=50")])
    assert load_config(None, [parse_override("export.int8_method=qat")]).export.int8_method == "qat"
    mixed = load_config(
        None, [parse_override("export.int8_method=mixed"), parse_override("export.int8_float_layers=3")]
    )
    assert (mixed.export.int8_method, mixed.export.int8_float_layers) == ("mixed", 3)


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match="train.epochs: expected int"):
        load_config(None, [parse_override("train.epochs=many")])


def test_saved_config_round_trips(tmp_path):
    config = load_config(
        None,
        [
            parse_override("data.sources={covid19-talo: {from_path: /x}}"),
            parse_override("train.model=mobilenet_v3_small"),
        ],
    )
    config.save(tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_cli_reports_config_errors_without_traceback(tmp_path):
    result = run_cli("train", "--set", "train.nonsense=1", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "unknown key(s) nonsense" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_reports_missing_data_without_traceback(tmp_path):
    result = run_cli("train", "--data-dir", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "run `covidxray prepare` first" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.epochs=0", "train.epochs: 0 is below the minimum 1"),
        ("train.epochs=-1", "train.epochs: -1 is below the minimum 1"),
        ("train.learning_rate=-0.001", "train.learning_rate: -0.001 must be greater than 0"),
        ("train.batch_size=0", "train.batch_size: 0 is below the minimum 1"),
        ("data.records_per_shard=0", "data.records_per_shard: 0 is below the minimum 1"),
        ("data.seed=-1", "data.seed: -1 is below the minimum 0"),
        ("train.seed=-1", "train.seed: -1 is below the minimum 0"),
        ("data.image_size=0", "data.image_size: 0 is below the minimum 16"),
        ("export.int8_min_agreement=1.5", "export.int8_min_agreement: 1.5 is above the maximum 1"),
        ("train.gradient_compression=fp8", "train.gradient_compression: 'fp8' is not one of none, fp16"),
        ("train.fusion_buffer_mb=-1", "train.fusion_buffer_mb: -1 is below the minimum 0"),
        ("train.cycle_time_ms=0", "train.cycle_time_ms: 0.0 must be greater than 0"),
        ("export.layout_margin=0", "export.layout_margin: 0.0 must be greater than 0"),
        ("export.layout_margin=500", "export.layout_margin: 500.0 is above the maximum 100"),
        ("export.int8_method=dynamic", "export.int8_method: 'dynamic' is not one of ptq, qat, mixed"),
        ("export.int8_float_layers=0", "export.int8_float_layers: 0 is below the minimum 1"),
        ("export.int8_float_layers=1.5", "export.int8_float_layers: expected an integer, got 1.5"),
        ("export.int8_qat_steps=0", "export.int8_qat_steps: 0 is below the minimum 1"),
        ("export.int8_qat_learning_rate=0", "export.int8_qat_learning_rate: 0.0 must be greater than 0"),
        ("export.int8_qat_learning_rate=0.5", "export.int8_qat_learning_rate: 0.5 is above the maximum 0.01"),
    ],
)
def test_out_of_range_values_are_rejected_with_the_key(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [parse_override(override)])
    assert message in str(caught.value)


def test_fractions_must_leave_a_training_split():
    with pytest.raises(ConfigError, match=r"val_fraction \(0.5\) \+ test_fraction \(0.5\) must be below 1"):
        load_config(None, [parse_override("data.val_fraction=0.5"), parse_override("data.test_fraction=0.5")])


def test_cli_rejects_a_zero_epoch_run_by_name(tmp_path):
    result = run_cli("train", "--set", "train.epochs=0", "--data-dir", str(tmp_path))
    assert result.returncode == 2 and "train.epochs: 0 is below the minimum 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_source_given_twice_is_an_error_and_config_options_survive_a_path():
    from covidxray.cli import parse_sources
    from covidxray.errors import UserError

    with pytest.raises(UserError, match="--source covid19-talo is given twice"):
        parse_sources(["covid19-talo=/a", "covid19-talo=/b"])
    configured = {"kermany": {"part": "oct"}, "synthetic": {}}
    assert parse_sources(["kermany=/data/oct"], configured=configured) == {
        "kermany": {"part": "oct", "from_path": "/data/oct"}
    }
