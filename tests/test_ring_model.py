"""Issue 18: the ring-allreduce cost model of scripts/bench_allreduce.py (scripts/_ring.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import _ring  # noqa: E402


def test_fit_recovers_bandwidth_and_latency_from_noisy_ring_timings():
    bandwidth, latency = 110e6, 180e-6  # bytes/s, s
    rng = np.random.default_rng(7)
    points = []
    for ranks in (2, 4, 8):
        for mib in (1, 2, 4, 8, 16, 32, 64, 128):
            size = mib * 2**20
            exact = 2 * (ranks - 1) / ranks * size / bandwidth + 2 * (ranks - 1) * latency  # written out, not _ring's
            points.append((ranks, size, exact * (1 + rng.normal(0, 0.02))))
    fit = _ring.fit(points)
    assert fit["bandwidth_bytes_per_s"] == pytest.approx(bandwidth, rel=0.02)
    assert fit["latency_s"] == pytest.approx(latency, rel=0.25)
    assert fit["rms_residual"] == pytest.approx(0.02, abs=0.01) and len(fit["residuals"]) == len(points)


def test_fit_keeps_latency_non_negative_when_bandwidth_explains_everything():
    points = [
        (ranks, mib * 2**20, 2 * (ranks - 1) / ranks * mib * 2**20 / 11e6 * (1 - 0.01 * ranks))
        for ranks in (2, 4, 8)
        for mib in (1, 4, 16, 64)
    ]
    fit = _ring.fit(points)  # unconstrained, these (faster at more ranks) would need a negative L
    assert fit["latency_s"] == 0.0
    assert fit["bandwidth_bytes_per_s"] == pytest.approx(11e6 / 0.955, rel=0.02)


def test_floor_is_the_ring_at_the_ethernet_payload_rate():
    # 8 ranks, 128 MiB over 1 GbE: 2*7/8 of the bytes through each link at 1448/1538 of 125 MB/s
    assert _ring.floor_seconds(8, 128 * 2**20, 1000) == pytest.approx(1.75 * 134217728 / (125e6 * 1448 / 1538))
    assert _ring.payload_bandwidth(1000) * 8 / 1e6 == pytest.approx(941.5, abs=0.1)


def test_step_prediction_without_and_with_overlap():
    predicted = _ring.predict_step(compute_s=0.9, allreduce_s=0.1, ranks=35, batch_per_rank=16)
    assert predicted["efficiency"] == pytest.approx(0.9)
    assert predicted["images_per_s"] == pytest.approx(35 * 16 / 1.0)
    assert predicted["efficiency_full_overlap"] == 1.0  # the allreduce hides entirely behind a longer backprop
    assert _ring.predict_step(0.1, 0.3, 35, 16)["efficiency_full_overlap"] == pytest.approx(1 / 3)
