"""Issue 24: predict warns (and still answers) when an image looks unlike every training source."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import run_cli, write_rebound
from sklearn.covariance import LedoitWolf

from covidxray.edge.source_profile import SourceProfile, from_card
from covidxray.export.source_profile import fit
from covidxray.sidecar import Sidecar


@pytest.fixture(scope="module")
def two_sources():
    """Embeddings of two sources with different means and a shared correlated spread."""
    rng = np.random.default_rng(5)
    mixing = rng.normal(size=(6, 6))
    means = {"a": np.zeros(6), "b": np.full(6, 4.0)}

    def draw(source, n):
        return rng.normal(size=(n, 6)) @ mixing + means[source], np.array([source] * n, dtype=object)

    parts = [draw("a", 300), draw("b", 200)]
    train = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    parts = [draw("a", 60), draw("b", 40)]
    val = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return train, val, mixing, means


def test_limits_and_ratios_match_an_independent_mahalanobis(two_sources):
    (train, train_sources), (val, val_sources), _, _ = two_sources
    profile = fit(train, train_sources, val, val_sources, margin=1.5)
    assert profile.sources == ["a", "b"]
    centred = (
        train
        - np.where((train_sources == "a")[:, None], train[train_sources == "a"].mean(0), 0)
        - np.where((train_sources == "b")[:, None], train[train_sources == "b"].mean(0), 0)
    )
    precision = LedoitWolf(assume_centered=True).fit(centred).precision_
    for i, source in enumerate("ab"):
        mean = train[train_sources == source].mean(0)
        d = val[val_sources == source] - mean
        own = np.sqrt(np.einsum("nd,de,ne->n", d, precision, d))
        assert profile.limits[i] == pytest.approx(own.max() * 1.5, rel=1e-6)
    probe = val[:5]
    d = probe[:, None, :] - np.stack([train[train_sources == s].mean(0) for s in "ab"])[None]
    expected = np.sqrt(np.einsum("nsd,de,nse->ns", d, precision, d)) / profile.limits
    np.testing.assert_allclose(profile.ratios(probe), expected, rtol=1e-6)


def test_an_image_like_no_source_is_warned_about_and_one_like_a_source_is_not(two_sources):
    (train, train_sources), (val, val_sources), mixing, means = two_sources
    profile = fit(train, train_sources, val, val_sources, margin=1.0)
    near_b = means["b"] + 0.1 * np.ones(6) @ mixing
    far = means["b"] + 40 * np.ones(6)
    assert profile.assess(near_b) == {"nearest_source": "b", "ratio": pytest.approx(profile.ratios(near_b[None])[0, 1])}
    warned = profile.assess(far)
    assert warned["ratio"] > 1 and "unlike every training source" in warned["warning"]
    assert not profile.unlike_every_source(val).any()  # limits are the val images' largest distances: none beyond


def test_the_sidecar_entry_round_trips_and_damage_is_named(two_sources):
    (train, train_sources), (val, val_sources), _, _ = two_sources
    profile = fit(train, train_sources, val, val_sources, margin=1.0)
    entry = json.loads(json.dumps(profile.to_sidecar({"margin": 1.0})))
    again = from_card(Sidecar(labels=["a", "b"], image_size=64, source_profile=entry))
    np.testing.assert_allclose(again.ratios(val), profile.ratios(val), rtol=1e-5)  # float32 in the sidecar
    assert from_card(Sidecar(labels=["a", "b"], image_size=64)) is None
    with pytest.raises(ValueError, match="source-profile section is damaged"):
        from_card(Sidecar(labels=["a", "b"], image_size=64, source_profile={**entry, "limits": [1.0]}))
    with pytest.raises(ValueError, match=r"limits \[0.0, 1.0\]"):  # a zero limit would divide by zero
        SourceProfile.from_sidecar({**entry, "limits": [0.0, 1.0]})


@pytest.mark.slow
def test_predict_warns_beside_the_answer_never_instead_of_it(exported_run, synthetic_data, tmp_path):
    from covidxray.data.tfrecord import read_records
    from covidxray.manifest import open_prepared

    run_dir = tmp_path / "run"
    shutil.copytree(exported_run, run_dir, ignore=shutil.ignore_patterns("checkpoints", "saved_model"))
    sidecar_path = run_dir / "model-float32.json"
    sidecar = json.loads(sidecar_path.read_text())
    assert sidecar["source_profile"]["sources"] == ["synthetic"]
    import cv2

    image = tmp_path / "film.png"
    cv2.imwrite(str(image), next(iter(read_records(open_prepared(synthetic_data).shards("test"))))["image"])

    def predict():
        result = run_cli("predict", str(image), "--model", str(run_dir), "--json")
        assert result.returncode == 0, result.stderr[-2000:]  # a warning is no failure
        return json.loads(result.stdout)[0], result.stderr

    answer, _ = predict()
    assert answer["label"] and answer["source_profile"]["nearest_source"] == "synthetic"
    sidecar["source_profile"]["limits"] = [answer["source_profile"]["ratio"] * 1e-3]  # every image now "far"
    write_rebound(run_dir / "model-float32.tflite", run_dir, sidecar)  # an edit re-bound, as an export writes it
    warned, stderr = predict()
    assert warned["label"] == answer["label"] and warned["probabilities"] == answer["probabilities"]
    assert "unlike every training source" in warned["source_profile"]["warning"]
    assert "unlike every training source" in stderr
