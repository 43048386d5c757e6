"""Property-based tests (Hypothesis) of the parsers that read what a user or a download hands us (issue 25, item 10):
the config loader with --set, the manifest loader and the metadata CSV readers. Whatever the input, the answer is
a value or the documented UserError/ConfigError, never another exception or a hang. Each test is bounded: a fixed
number of examples, derandomised (the same inputs on every run), each within a deadline.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from covidxray.config import Config, ConfigError, load_config, parse_override
from covidxray.errors import UserError
from covidxray.manifest import SHARD_DIR, check_model_matches, open_prepared, seal, shard_problems
from covidxray.records import Dropped, Record
from covidxray.run_folder import ModelCard
from covidxray.sources.covid_chestxray import CovidChestXraySource
from covidxray.sources.layout import within

BOUNDED = settings(
    max_examples=80,
    deadline=2000,  # ms per example
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
yaml_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), children, max_size=4)
    ),
    max_leaves=20,
)
config_keys = st.sampled_from(
    [
        f"{section}.{name}"
        for section, names in {
            "data": [f for f in Config().data.__dataclass_fields__],
            "train": [f for f in Config().train.__dataclass_fields__],
            "export": [f for f in Config().export.__dataclass_fields__],
        }.items()
        for name in names
    ]
    + ["data", "train", "nosuch.key", "data.sources.covid19-talo", "data.label_overrides.Unknown"]
)


# ------------------------------------------------------------------ config


def load_or_config_error(*args) -> Config | None:
    try:
        return load_config(*args)
    except ConfigError:
        return None


def limits_hold(config: Config) -> None:
    """What load_config promises of a config it returns: finite numbers, and values that save and load again."""
    for section in (config.data, config.train, config.export):
        for name, value in vars(section).items():
            if isinstance(value, float):
                assert math.isfinite(value), name
    assert config.data.val_fraction + config.data.test_fraction < 1


set_values = st.text(max_size=40) | st.sampled_from(
    [
        '!!python/object/apply:os.system ["true"]',
        "!!python/name:os.system",
        "!!binary AAAA",
        "&a [*a]",
        "[[[[[[[[[[",
        "{1: 2}",
        ".nan",
        "-.inf",
        "1e999",
        "0x7fffffffffffffffffff",
    ]
)


@BOUNDED
@given(st.text(max_size=80) | st.builds(lambda key, value: f"{key}={value}", config_keys, set_values))
def test_any_set_text_is_a_config_or_a_config_error(text):
    try:
        override = parse_override(text)
    except ConfigError:
        return
    config = load_or_config_error(None, [override])
    if config is not None:
        limits_hold(config)


@BOUNDED
@given(config_keys, yaml_values)
def test_any_value_for_any_key_is_a_config_or_a_config_error(key, value):
    config = load_or_config_error(None, [parse_override(f"{key}={yaml.safe_dump(value, default_flow_style=True)}")])
    if config is None:
        return
    limits_hold(config)
    with tempfile.TemporaryDirectory() as folder:  # a config it accepted is one it can save and read back
        path = Path(folder) / "config.yaml"
        config.save(path)
        again = load_config(path)
    if "@" not in json.dumps(config.data.sources, default=str):  # a url's password is hidden on save, on purpose
        assert again == config


@BOUNDED
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_config_file_is_a_config_or_a_config_error(content):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.yaml"
        path.write_bytes(content)
        config = load_or_config_error(path)
    if config is not None:
        limits_hold(config)


# ------------------------------------------------------------------ manifest


def a_manifest() -> dict:
    """A manifest as prepare writes it, before sealing: two shards of a two-class task."""
    classes = {"normal": 3, "pneumonia": 2}
    return {
        "format": "covidxray-shards/1",
        "task": "pneumonia",
        "labels": ["normal", "pneumonia"],
        "image_size": 64,
        "preprocessing": 3,
        "splits": {
            s: {"records": 5, "patients": 4, "classes": classes, "sources": {"synthetic": 5}}
            for s in ("train", "val", "test")
        },
        "shards": [
            {"file": f"{s}-00000-of-00001-0123456789ab.tfrecord", "split": s, "records": 5, "sha256": "ab" * 32}
            for s in ("train", "val", "test")
        ],
        "data_config": {"holdout_source": ""},
        "table_sha256": {"splits.csv": "cd" * 32},
    }


def use_manifest(data_dir: Path) -> None:
    """Load it as train, evaluate and doctor do; every answer a value or a UserError."""
    try:
        data = open_prepared(data_dir)
    except UserError:
        return
    manifest = data.manifest
    for split in ("train", "val", "test"):
        for path in data.shards(split):
            assert path.parent == data_dir / SHARD_DIR  # a name in the manifest never reaches outside shards/
        assert isinstance(manifest.splits[split].records, int) and manifest.splits[split].records >= 0
        assert all(isinstance(n, int) and n >= 0 for n in manifest.splits[split].classes.values())
    shard_problems(data)
    try:
        check_model_matches(ModelCard(labels=["normal", "pneumonia"], image_size=64), data)
    except UserError:
        pass


@BOUNDED
@given(st.binary(max_size=300))
def test_any_bytes_as_manifest_are_refused_cleanly(content):
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "manifest.json").write_bytes(content)
        use_manifest(Path(folder))


@BOUNDED
@given(json_values)
def test_any_sealed_json_is_a_manifest_or_a_user_error(content):
    with tempfile.TemporaryDirectory() as folder:
        body = content if not isinstance(content, dict) else seal(content)
        (Path(folder) / "manifest.json").write_text(json.dumps(body))
        use_manifest(Path(folder))


def _paths(value, prefix=()):
    """Every (key path) inside a nested dict/list, the value at it included."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


@BOUNDED
@given(st.data())
def test_a_resealed_manifest_with_any_field_replaced_is_a_manifest_or_a_user_error(data):
    manifest = a_manifest()
    where = data.draw(st.sampled_from([p for p in _paths(manifest) if p]))
    replacement = data.draw(json_values | st.sampled_from(["../../etc/passwd", "/etc/passwd", "x/../../y.tfrecord"]))
    target = manifest
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = replacement
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "manifest.json").write_text(json.dumps(seal(manifest)))  # anyone can recompute the checksum
        use_manifest(Path(folder))


# ------------------------------------------------------------------ metadata CSV readers

IEEE_HEADER = ["patientid", "offset", "sex", "age", "finding", "survival", "view", "modality", "date", "location",
               "folder", "filename", "doi", "url", "license", "clinical_notes", "other_notes", ""]  # fmt: skip
cells = st.one_of(
    st.sampled_from(
        [
            "",
            "?",
            "PA",
            "AP Supine",
            "L",
            "X-ray",
            "CT",
            "images",
            "volumes",
            "COVID-19",
            "Pneumonia/Viral/COVID-19",
            "todo",
            "..",
            "/etc/passwd",
            "../../x.png",
            "a\x00b",
            "x" * 300,
        ]
    ),  # fmt: skip
    st.text(max_size=20),
)


def read_all(root: Path) -> None:
    """Every row of metadata.csv through the adapter: Records inside the folder and Dropped rows, or a UserError."""
    try:
        items = list(CovidChestXraySource().records(root))
    except UserError:
        return
    for item in items:
        assert isinstance(item, (Record, Dropped))
        if isinstance(item, Record):
            assert within(root, item.image) and item.image.is_file()


@BOUNDED
@given(st.binary(max_size=400))
def test_any_bytes_as_metadata_csv_are_rows_or_a_user_error(content):
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "images").mkdir()
        (root / "metadata.csv").write_bytes(content)
        read_all(root)


@BOUNDED
@given(st.lists(st.lists(cells, min_size=0, max_size=len(IEEE_HEADER) + 2), max_size=6))
def test_any_rows_under_the_real_header_are_records_inside_the_collection_or_drops(rows):
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "collection"
        (root / "images").mkdir(parents=True)
        (root / "images" / "x.png").write_bytes(b"not decoded here")
        (Path(folder) / "outside.png").write_bytes(b"never to be listed")
        text = io.StringIO()
        csv.writer(text).writerows([IEEE_HEADER, *rows])
        (root / "metadata.csv").write_text(text.getvalue(), encoding="utf-8", errors="surrogatepass")
        read_all(root)


@BOUNDED
@given(st.binary(max_size=300) | st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_any_splits_csv_is_read_or_refused_by_audit(content):
    from covidxray.data.audit import _prepared_records

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "splits.csv").write_bytes(content)
        try:
            records, split_of = _prepared_records(Path(folder))
        except UserError:
            return
        assert len(split_of) <= len(records)
