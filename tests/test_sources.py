"""Each adapter on a tiny copy of its collection's real layout: labels, patients, drops, fetch paths."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
from layouts import (
    FileServer,
    build_ieee8023,
    build_kaggle,
    build_mendeley_v2,
    build_mendeley_v3,
    build_talo,
    tar_tree,
    zip_tree,
)

from covidxray.config import ConfigError
from covidxray.errors import UserError
from covidxray.records import HARMONISED_LABELS, Dropped
from covidxray.sources import SOURCE_REGISTRY, SourceContext, build_source, zhanglab
from covidxray.sources.descriptors import DESCRIPTOR_DIR, load_descriptor

REAL_SOURCES = ("covid-chestxray", "chest-xray-pneumonia", "kermany", "covid19-talo")


def read(name: str, options: dict, cache: Path):
    source = build_source(name, options)
    root, provenance = source.fetch(cache)
    records, dropped = [], Counter()
    for item in source.records(root):
        if isinstance(item, Dropped):
            dropped[item.reason] += 1
        else:
            records.append(item)
    return provenance, root, records, dropped


def assert_matches(layout, records, dropped):
    assert {r.image.name: r.label for r in records} == layout.labels
    assert {r.image.name: r.patient_id for r in records} == layout.patients
    assert dropped == layout.dropped
    assert all(r.label in HARMONISED_LABELS for r in records)


def test_every_real_source_is_registered_with_a_sound_descriptor():
    assert set(REAL_SOURCES) <= set(SOURCE_REGISTRY)
    for name in REAL_SOURCES:
        descriptor = load_descriptor(name)
        assert descriptor.licence and descriptor.homepage.startswith("https://")
        assert set(descriptor.label_map.values()) <= set(HARMONISED_LABELS)
        for archive in descriptor.archives.values():  # a checksum is 64 hex digits or honestly unknown (None)
            assert archive.sha256 is None or len(archive.sha256) == 64
    assert sorted(p.stem for p in DESCRIPTOR_DIR.glob("*.yaml")) == sorted(REAL_SOURCES)


def test_a_non_editable_install_carries_the_descriptors(tmp_path):
    """`pip install ./covidxray` (as on a Pi) must still know the sources, not only an editable checkout."""
    repo = Path(__file__).resolve().parents[1]
    checkout = tmp_path / "checkout"  # built from a copy, so the test writes nothing into the repo
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(repo / "covidxray", checkout / "covidxray", symlinks=True, ignore=skip)
    shutil.copytree(repo / "datasets", checkout / "datasets")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(repo / name, checkout / name)
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(checkout),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    probe = (
        "import covidxray, json; from covidxray.sources.descriptors import load_descriptor;"
        "from covidxray.sources.covid19_talo import known_patient;"
        f"print(json.dumps([covidxray.__file__, known_patient('01E392EE-69F9-4E33-BFCE-E5C968654078.jpeg')]"
        f" + [load_descriptor(n).homepage for n in {list(REAL_SOURCES)!r}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    imported_from, talo_patient, *homepages = json.loads(out.stdout)
    assert Path(imported_from).is_relative_to(target)
    assert talo_patient == "covid-chestxray:46"  # the shipped ieee8023 table (metadata.csv: 01E392EE-... is patient 46)
    assert homepages == [load_descriptor(n).homepage for n in REAL_SOURCES]


@pytest.mark.parametrize("header", ["new", "old"])
def test_covid_chestxray_keeps_frontal_xrays_and_says_why_it_drops_the_rest(tmp_path, header):
    layout = build_ieee8023(tmp_path / "given", header)
    _, root, records, dropped = read("covid-chestxray", {"from_path": str(tmp_path / "given")}, tmp_path / "cache")
    assert root == layout.root
    assert_matches(layout, records, dropped)
    assert {r.view for r in records} <= {"PA", "AP", "AP Supine", "APS", "AP semi erect"}


def test_covid_chestxray_rejects_a_foreign_csv(tmp_path):
    root = tmp_path / "repo"
    (root / "images").mkdir(parents=True)
    (root / "metadata.csv").write_text("id,label\n1,covid\n")
    with pytest.raises(UserError, match="patientid"):
        read("covid-chestxray", {"from_path": str(root)}, tmp_path / "cache")


def test_kaggle_tree_skips_the_nested_copy_and_macos_junk(tmp_path):
    layout = build_kaggle(tmp_path / "given")
    _, root, records, dropped = read("chest-xray-pneumonia", {"from_path": str(tmp_path / "given")}, tmp_path / "cache")
    assert root == layout.root  # chest_xray/, not chest_xray/chest_xray/
    assert_matches(layout, records, dropped)
    assert not any("__MACOSX" in str(r.image) or "chest_xray/chest_xray" in str(r.image) for r in records)
    assert {r.original_split for r in records} == {"train", "val", "test"}
    # bacteria and virus are two numberings; one number of one cause is one patient in train and test
    person1 = {(r.original_split, r.patient_id) for r in records if r.image.name.startswith("person1_")}
    assert person1 == {
        ("train", "chest-xray-pneumonia:person1_bacteria"),
        ("train", "chest-xray-pneumonia:person1_virus"),
        ("test", "chest-xray-pneumonia:person1_virus"),
    }


def test_kaggle_download_through_a_faked_api(tmp_path, monkeypatch):
    """The adapter drives the kaggle package as the real one is driven; the fake writes a real zip."""
    layout = build_kaggle(tmp_path / "content")
    calls = []

    class FakeKaggleApi:
        def authenticate(self):
            calls.append("authenticate")

        def dataset_download_files(self, dataset, path=None, force=False, quiet=True, unzip=False):
            calls.append((dataset, unzip))
            zip_tree(tmp_path / "content", Path(path) / f"{dataset.split('/')[1]}.zip")

    monkeypatch.setitem(sys.modules, "kaggle", types.SimpleNamespace(KaggleApi=FakeKaggleApi))
    _, root, records, dropped = read("chest-xray-pneumonia", {}, tmp_path / "cache")
    assert calls == ["authenticate", ("paultimothymooney/chest-xray-pneumonia", False)]
    assert root == tmp_path / "cache" / "extracted" / "chest-xray-pneumonia" / "chest_xray"
    assert_matches(layout, records, dropped)
    read("chest-xray-pneumonia", {}, tmp_path / "cache")  # already unpacked: Kaggle is not asked again
    assert len(calls) == 2


def fresh_kaggle(monkeypatch, tmp_path, **env):
    """The real kaggle package imported anew, with only the given credentials in the environment."""
    for var in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN", "KAGGLE_ENABLE_OAUTH", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(tmp_path / "home" / ".kaggle"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for module in [m for m in sys.modules if m == "kaggle" or m.startswith("kaggle.")]:
        monkeypatch.delitem(sys.modules, module)


def test_kaggle_without_credentials_says_how_to_provide_them(tmp_path, monkeypatch):
    """The real kaggle package, with no token anywhere, must turn into one actionable error."""
    fresh_kaggle(monkeypatch, tmp_path)
    with pytest.raises(UserError, match=r"kaggle\.json.*KAGGLE_USERNAME.*--from"):
        read("chest-xray-pneumonia", {}, tmp_path / "cache")


def test_kermany_v2_archives_chest_and_oct(tmp_path):
    chest, oct_ = build_mendeley_v2(tmp_path / "content")
    chest_zip = zip_tree(chest.root, tmp_path / "ChestXRay2017.zip")
    oct_tgz = tar_tree(oct_.root, tmp_path / "OCT2017.tar.gz")
    _, _, records, dropped = read("kermany", {"from_path": str(chest_zip), "version": 2}, tmp_path / "cache")
    assert_matches(chest, records, dropped)
    assert "val" not in {r.original_split for r in records}
    _, _, records, dropped = read("kermany", {"from_path": str(oct_tgz), "part": "oct"}, tmp_path / "cache")
    assert_matches(oct_, records, dropped)
    assert {r.view for r in records} == {"oct"}


def test_kermany_v3_renamed_files_and_parts_of_one_tree(tmp_path):
    chest, oct_ = build_mendeley_v3(tmp_path / "content")
    archive = zip_tree(chest.root, tmp_path / "ZhangLabData.zip")
    _, root, records, dropped = read("kermany", {"from_path": str(archive)}, tmp_path / "cache")
    assert root.parts[-2:] == ("CellData", "chest_xray")
    assert_matches(chest, records, dropped)
    _, root, records, dropped = read("kermany", {"from_path": str(archive), "part": "oct"}, tmp_path / "cache")
    assert root.parts[-2:] == ("CellData", "OCT")
    assert_matches(oct_, records, dropped)


def test_kermany_rejects_unknown_part_and_version():
    with pytest.raises(ConfigError, match="part"):
        build_source("kermany", {"part": "knee"})
    with pytest.raises(ConfigError, match="version"):
        build_source("kermany", {"version": 4})
    with pytest.raises(ConfigError, match="unknown key"):
        build_source("kermany", {"versoin": 2})


def test_talo_tree_groups_case_images_and_nih_follow_ups(tmp_path):
    layout = build_talo(tmp_path / "given")
    _, root, records, dropped = read("covid19-talo", {"from_path": str(tmp_path / "given")}, tmp_path / "cache")
    assert root == layout.root
    assert_matches(layout, records, dropped)
    patients = Counter(r.patient_id for r in records)
    assert patients["covid19-talo:nih:00001280"] == 2 and patients["covid-chestxray:19"] == 2
    assert patients["covid19-talo:case:covid-19-case-report-7"] == 2


def test_talo_real_sample(shared_data, tmp_path):
    _, _, records, dropped = read(
        "covid19-talo", {"from_path": str(shared_data / "covid19-talo-sample")}, tmp_path / "cache"
    )
    assert Counter(r.label for r in records) == {"covid-19": 8, "normal": 8, "pneumonia": 8}
    assert not dropped
    assert {r.patient_id for r in records if r.image.name == "00001280_004.png"} == {"covid19-talo:nih:00001280"}
    # every COVID image has the patient ieee8023's own metadata.csv gives its original (the oracle, read here directly)
    with open(
        shared_data / "covid-chestxray-sample" / "covid-chestxray-dataset" / "metadata.csv", newline=""
    ) as handle:
        ieee = {row["filename"]: f"covid-chestxray:{row['patientid']}" for row in csv.DictReader(handle)}
    covid = [r for r in records if r.label == "covid-19"]
    assert {r.image.name: r.patient_id for r in covid} == {r.image.name: ieee[r.image.name] for r in covid}


def test_every_real_kaggle_name_has_a_patient(shared_data):
    names = sorted(p.name for p in (shared_data / "chest-xray-pneumonia-224" / "chest_xray").glob("*/*/*.jpeg"))
    assert len(names) == 5840  # the listing (train 1341 + 3875, test 234 + 390)
    assert [n for n in names if zhanglab.parse_name(Path(n).stem) is None] == []
    patients = {n: zhanglab.parse_name(Path(n).stem)[0] for n in names}
    assert patients["IM-0011-0001-0001.jpeg"] == patients["IM-0011-0001-0002.jpeg"] == "IM-0011"
    assert patients["NORMAL2-IM-0173-0001-0002.jpeg"] == "NORMAL2-IM-0173"
    assert patients["person447_virus_921_1.jpeg"] == patients["person447_virus_921.jpeg"] == "person447_virus"
    assert patients["person447_bacteria_1932.jpeg"] == "person447_bacteria"


def test_download_from_a_mirror_url_with_checksum(tmp_path):
    layout = build_talo(tmp_path / "content")
    payload = zip_tree(tmp_path / "content", tmp_path / "COVID-19-master.zip").read_bytes()
    digest = hashlib.sha256(payload).hexdigest()
    with FileServer({"/COVID-19-master.zip": payload}) as server:
        provenance, root, records, dropped = read(
            "covid19-talo", {"url": server.url("/COVID-19-master.zip"), "sha256": digest}, tmp_path / "cache"
        )
        assert_matches(layout, records, dropped)
        assert provenance["sha256"] == digest and provenance["url"].startswith("http://127.0.0.1")
        heard: list[str] = []  # the run's reporter, not a hard-wired stderr, hears the download and the unpack
        source = build_source(
            "covid19-talo", {"url": server.url("/COVID-19-master.zip")}, SourceContext(say=heard.append)
        )
        source.fetch(tmp_path / "heard-cache")
        assert any(line.startswith("downloading http://127.0.0.1") for line in heard), heard
        with pytest.raises(UserError, match=f"expected sha256 {'a' * 64}, got {digest}"):
            read(
                "covid19-talo",
                {"url": server.url("/COVID-19-master.zip"), "sha256": "a" * 64},
                tmp_path / "other-cache",
            )
        assert not (tmp_path / "other-cache" / "downloads" / "COVID-19-master.zip").exists()


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_receipt_lost_in_a_crash_is_written_again_without_a_new_download(tmp_path, damage):
    """A run stopped between the unpack and the receipt (or an old, half-written receipt) must not lose where the
    data came from: the next fetch writes the receipt again from the kept download, and fetches nothing."""
    build_talo(tmp_path / "content")
    payload = zip_tree(tmp_path / "content", tmp_path / "COVID-19-master.zip").read_bytes()
    digest = hashlib.sha256(payload).hexdigest()
    with FileServer({"/COVID-19-master.zip": payload}) as server:
        options = {"url": server.url("/COVID-19-master.zip"), "sha256": digest}
        first, *_ = read("covid19-talo", options, tmp_path / "cache")
        (receipt,) = (tmp_path / "cache" / "extracted").glob("*.json")
        if damage == "missing":
            receipt.unlink()
        else:
            receipt.write_text(receipt.read_text()[:20])
        requests = len(server.requests)
        again, *_ = read("covid19-talo", options, tmp_path / "cache")
        assert len(server.requests) == requests  # the archive kept in downloads/ was used
    assert again == first and again["sha256"] == digest
    assert json.loads(receipt.read_text())["sha256"] == digest


def test_from_path_mistakes_are_actionable(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read("covid19-talo", {"from_path": str(tmp_path / "nowhere.zip")}, tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="does not hold the covid19-talo layout"):
        read("covid19-talo", {"from_path": str(tmp_path / "empty")}, tmp_path / "cache")
    broken = tmp_path / "COVID-19-master.zip"
    broken.write_bytes(b"PK\x03\x04 truncated download")
    with pytest.raises(UserError, match="COVID-19-master.zip"):
        read("covid19-talo", {"from_path": str(broken)}, tmp_path / "cache")
    layout = build_talo(tmp_path / "content")
    archive = zip_tree(tmp_path / "content", tmp_path / "talo.zip")
    with pytest.raises(UserError, match="checksum mismatch"):
        read("covid19-talo", {"from_path": str(archive), "sha256": "b" * 64}, tmp_path / "cache")
    assert archive.is_file()  # the user's own file is never deleted
    assert layout.labels


def test_no_url_known_points_to_the_manual_route(tmp_path):
    source = build_source("kermany", {"version": 2, "part": "oct"})
    archive = source.archive()
    no_url = type(archive)(archive.key, archive.file, None, None, "not published")
    with pytest.raises(UserError, match="no download URL.*--from"):
        source.download(no_url, tmp_path)


# --- ieee8023 metadata generations, decisions and overrides (issue 15) -------------------------

AUG_2020 = "covid-chestxray-sample/covid-chestxray-dataset"
EXCLUDED_ARDS = "finding 'ARDS' excluded: ARDS alone is a syndrome (sepsis, trauma, bites...), not a pneumonia"
UNKNOWN_VIEW = "view unknown (blank, '?' or no view column); source option unknown_view: keep takes it as frontal"

# Derived by hand from the raw columns of the Aug 2020 metadata.csv (finding x view x modality x folder
# tallies), with the decisions of datasets/covid-chestxray.yaml applied by hand, not by the adapter:
# - kept: frontal (PA, AP, AP Supine) X-rays in images/ with a mapped finding:
#   covid-19 = COVID-19 (PA 201 + AP Supine 122 + AP 94) + "COVID-19, ARDS" (PA 11 + AP Supine 1) = 429
#   pneumonia/viral = SARS (PA 8 + AP 8) + Varicella (PA 3 + AP 1) + Influenza (PA 1) = 21
#   pneumonia/bacterial = Streptococcus 13 + Klebsiella 7 + E.Coli 4 (AP Supine) + Mycoplasma Bacterial
#     Pneumonia 4 + Legionella 3 + Bacterial 2 + Chlamydophila 1 (all PA unless said) = 34
#   pneumonia/fungal = Pneumocystis PA 13; pneumonia/other = Lipoid PA 3
#   pneumonia = Pneumonia (PA 6 + AP Supine 4) = 10; normal = No Finding (PA 8 + AP Supine 3 + AP 2) = 13
# - dropped: 21 CT volumes (folder volumes); 63 CT slices in images/ (84 CT rows - 21 volumes);
#   57 laterals (L, all X-ray); 39 unknown views (35 blank + 4 '?', all todo); 51 not labelled yet
#   (frontal X-ray todo: AP Supine 22 + PA 15 + AP 13, and 1 Unknown); 4 ARDS (all PA).
# 523 kept + 235 dropped = 758 rows.
AUG_2020_CLASSES = {
    "covid-19": 429,
    "pneumonia/viral": 21,
    "pneumonia/bacterial": 34,
    "pneumonia/fungal": 13,
    "pneumonia/other": 3,
    "pneumonia": 10,
    "normal": 13,
}
AUG_2020_DROPPED = {
    "CT volume (volumes/), not a radiograph": 21,
    "modality CT is not X-ray": 63,
    "view L is not frontal": 57,
    UNKNOWN_VIEW: 39,
    "finding not labelled yet (todo/Unknown)": 51,
    EXCLUDED_ARDS: 4,
}


def aug_2020_with_every_image(shared_data: Path, target: Path) -> Path:
    """The real metadata.csv beside an images/ folder holding a (placeholder) file for every row,
    so that all 758 rows are judged on their metadata, not on which 96 images the sample carries."""
    (target / "images").mkdir(parents=True)
    shutil.copy2(shared_data / AUG_2020 / "metadata.csv", target / "metadata.csv")
    with open(target / "metadata.csv", newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            (target / "images" / row["filename"]).touch()
    return target


def test_aug_2020_metadata_gives_the_hand_derived_counts_per_class_and_drop_reason(shared_data, tmp_path):
    root = aug_2020_with_every_image(shared_data, tmp_path / "repo")
    _, _, records, dropped = read("covid-chestxray", {"from_path": str(root)}, tmp_path / "cache")
    assert len(records) + sum(dropped.values()) == 758
    assert Counter(r.label for r in records) == AUG_2020_CLASSES
    assert dropped == AUG_2020_DROPPED
    assert {r.view for r in records} == {"PA", "AP", "AP Supine"}


def test_aug_2020_sample_keeps_exactly_the_listed_images_it_holds(shared_data, tmp_path):
    """On the sample as it is (96 of the images), a kept row is one whose image is present."""
    root = shared_data / AUG_2020
    _, _, records, dropped = read("covid-chestxray", {"from_path": str(root)}, tmp_path / "cache")
    with_images = aug_2020_with_every_image(shared_data, tmp_path / "repo")
    _, _, all_records, _ = read("covid-chestxray", {"from_path": str(with_images)}, tmp_path / "cache2")
    present = {r.image.name for r in all_records if (root / "images" / r.image.name).is_file()}
    assert {r.image.name for r in records} == present and len(present) > 50
    assert dropped["image file listed in metadata.csv is missing"] == len(all_records) - len(records)


def test_label_overrides_map_unknown_findings_and_override_exclusions(shared_data, tmp_path):
    root = aug_2020_with_every_image(shared_data, tmp_path / "repo")
    # matched like findings: case-insensitive
    overrides = SourceContext(label_overrides={"ards": "pneumonia/other", "Lipoid": "pneumonia"})
    source = build_source("covid-chestxray", {"from_path": str(root)}, overrides)
    records = [item for item in source.records(source.fetch(tmp_path / "cache").root) if not isinstance(item, Dropped)]
    labels = Counter(r.label for r in records)
    assert labels["pneumonia/other"] == 4 and labels["pneumonia"] == 10 + 3  # ARDS now kept; Lipoid moved
    assert labels["covid-19"] == 429  # "COVID-19, ARDS" is listed whole, so overriding ARDS leaves it covid-19


def test_label_overrides_are_validated_with_the_key_named():
    from covidxray.config import load_config

    assert load_config(None, [{"data": {"label_overrides": {"ARDS": "pneumonia/other"}}}]).data.label_overrides == {
        "ARDS": "pneumonia/other"
    }
    with pytest.raises(
        ConfigError, match=r"data\.label_overrides\.ARDS: 'pneumonia/ards' is not one of normal, pneumonia"
    ):
        load_config(None, [{"data": {"label_overrides": {"ARDS": "pneumonia/ards"}}}])


EARLIEST_HEADER = "Patientid,offset,sex,age,finding,survival,date,location,filename,doi,url,license,notes"


@pytest.mark.parametrize("unknown_view", ["drop", "keep"])
def test_metadata_without_a_view_column_is_read_and_unknown_views_follow_the_option(tmp_path, unknown_view):
    root = tmp_path / "covid-chestxray-dataset"
    (root / "images").mkdir(parents=True)
    rows = [("1", "COVID-19", "a.jpeg"), ("2", "SARS", "b.jpeg"), ("3", "ARDS", "c.png")]
    (root / "metadata.csv").write_text(
        EARLIEST_HEADER + "\n" + "".join(f"{p},,,,{f},,2020,,{n},,,,\n" for p, f, n in rows)
    )
    for _, _, name in rows:
        (root / "images" / name).touch()
    _, _, records, dropped = read(
        "covid-chestxray", {"from_path": str(root), "unknown_view": unknown_view}, tmp_path / "cache"
    )
    if unknown_view == "drop":
        assert not records and dropped == {UNKNOWN_VIEW: 3}
    else:
        assert {r.image.name: (r.label, r.view) for r in records} == {
            "a.jpeg": ("covid-19", "unknown"),
            "b.jpeg": ("pneumonia/viral", "unknown"),
        }
        assert dropped == {EXCLUDED_ARDS: 1}
    with pytest.raises(ConfigError, match="unknown_view: 'maybe' is not one of drop, keep"):
        build_source("covid-chestxray", {"unknown_view": "maybe"})


# --- Kaggle: network failures are not credential failures (issue 15) --------------------------


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the probe is closed


def test_bogus_token_without_network_is_reported_as_a_network_failure(tmp_path, monkeypatch):
    """The real kaggle 2.x checks KAGGLE_API_TOKEN over the network; every connection here goes to a
    proxy on a closed local port, so there is no network whatever the machine has."""
    proxy = f"http://127.0.0.1:{closed_port()}"
    fresh_kaggle(monkeypatch, tmp_path, KAGGLE_API_TOKEN="not-a-real-token", HTTPS_PROXY=proxy, HTTP_PROXY=proxy)
    with pytest.raises(UserError) as caught:
        read("chest-xray-pneumonia", {}, tmp_path / "cache")
    message = str(caught.value)
    assert message.startswith("could not reach Kaggle while authenticating") and "not a credentials one" in message
    assert "HTTPS_PROXY" in message and "--from" in message and "kaggle.json" not in message


def http_error(status: int):
    import requests

    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(f"{status} Client Error", response=response)


def connection_error_inside_a_client_error():
    import requests

    try:
        try:
            raise requests.ConnectionError("Failed to resolve 'api.kaggle.com'")
        except requests.ConnectionError as inner:
            raise RuntimeError("kagglesdk call failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "when, raised, says",
    [
        (
            "authenticate",
            lambda: SystemExit(1),
            r"^Kaggle did not accept the credentials while authenticating \(no usable.*kaggle\.json.*--from",
        ),
        (
            "authenticate",
            lambda: http_error(401),
            r"^Kaggle did not accept the credentials while authenticating \(HTTP 401\)",
        ),
        (
            "authenticate",
            connection_error_inside_a_client_error,
            r"^could not reach Kaggle while authenticating \(Failed to resolve",
        ),
        (
            "download",
            connection_error_inside_a_client_error,
            r"^download of chest-xray-pneumonia.zip failed: could not reach Kaggle while downloading",
        ),
        (
            "download",
            lambda: http_error(503),
            r"^download of chest-xray-pneumonia.zip failed: Kaggle itself failed .*HTTP 503.*re-run later",
        ),
        (
            "download",
            lambda: http_error(404),
            r"Kaggle has no dataset paultimothymooney/chest-xray-pneumonia \(HTTP 404\)",
        ),
    ],
)
def test_kaggle_failures_say_whether_network_credentials_or_kaggle_is_at_fault(
    tmp_path, monkeypatch, when, raised, says
):
    class FailingKaggleApi:
        def authenticate(self):
            if when == "authenticate":
                raise raised()

        def dataset_download_files(self, dataset, path=None, force=False, quiet=True, unzip=False):
            raise raised()

    monkeypatch.setitem(sys.modules, "kaggle", types.SimpleNamespace(KaggleApi=FailingKaggleApi))
    with pytest.raises(UserError, match=says):
        read("chest-xray-pneumonia", {}, tmp_path / "cache")
