"""The ring-allreduce cost model used by bench_allreduce.py: fit, floor, and what it predicts for a training step.

A ring allreduce of S bytes over N ranks sends 2(N-1)/N * S bytes through
every rank's link (reduce-scatter then allgather) in 2(N-1) steps, so

    t(N, S) = 2(N-1)/N * S / B + 2(N-1) * L

with B the bandwidth of one link (bytes/s of payload) and L the cost of one
step beyond its bytes (latency plus per-message software overhead).
"""

from __future__ import annotations

import numpy as np

ETHERNET_PAYLOAD_SHARE = 1448 / 1538  # TCP payload per 1500-byte frame on the wire (timestamps on; preamble, FCS, gap)


def ring_seconds(ranks: int, size_bytes: float, bandwidth: float, latency: float) -> float:
    return 2 * (ranks - 1) / ranks * size_bytes / bandwidth + 2 * (ranks - 1) * latency


def payload_bandwidth(line_mbit: float) -> float:
    """Bytes/s of TCP payload a link of `line_mbit` Mbit/s can carry at most."""
    return line_mbit * 1e6 / 8 * ETHERNET_PAYLOAD_SHARE


def floor_seconds(ranks: int, size_bytes: float, line_mbit: float) -> float:
    """The physical floor: the ring's bytes at the line's payload rate, no latency at all."""
    return ring_seconds(ranks, size_bytes, payload_bandwidth(line_mbit), 0.0)


def fit(points: list[tuple[int, float, float]]) -> dict:
    """Least-squares B and L from (ranks, bytes, seconds) points, on relative error.

    Relative, because the times span two orders of magnitude: an absolute fit
    would be decided by the largest messages alone and say nothing about L.
    """
    ranks = np.array([p[0] for p in points], float)
    sizes = np.array([p[1] for p in points], float)
    seconds = np.array([p[2] for p in points], float)
    design = np.stack([2 * (ranks - 1) / ranks * sizes, 2 * (ranks - 1)], axis=1) / seconds[:, None]
    (inverse_bandwidth, latency), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if latency < 0:  # noise on a latency too small to see: a negative cost per step is not physical, so L = 0
        latency = 0.0
        (inverse_bandwidth,), *_ = np.linalg.lstsq(design[:, :1], np.ones_like(seconds), rcond=None)
    bandwidth = 1 / inverse_bandwidth
    predicted = np.array([ring_seconds(int(n), s, bandwidth, latency) for n, s in zip(ranks, sizes)])
    residuals = (seconds - predicted) / predicted
    return {
        "bandwidth_bytes_per_s": float(bandwidth),
        "bandwidth_mbit_per_s": float(bandwidth * 8 / 1e6),
        "latency_s": float(latency),
        "residuals": [float(r) for r in residuals],
        "rms_residual": float(np.sqrt(np.mean(residuals**2))),
        "max_abs_residual": float(np.max(np.abs(residuals))),
    }


def predict_step(compute_s: float, allreduce_s: float, ranks: int, batch_per_rank: int) -> dict:
    """Images/s and scaling efficiency of data-parallel training, without and with compute/communication overlap.

    Without overlap (the conservative case, used for the goal) a step is the
    compute then the allreduce. Horovod starts reducing a gradient as soon as
    backprop has produced it, so part of the allreduce hides behind the rest
    of backprop: full overlap bounds the step from below at max(compute, allreduce).
    """
    serial = compute_s + allreduce_s
    overlapped = max(compute_s, allreduce_s)
    return {
        "images_per_s": ranks * batch_per_rank / serial,
        "efficiency": compute_s / serial,
        "images_per_s_full_overlap": ranks * batch_per_rank / overlapped,
        "efficiency_full_overlap": compute_s / overlapped,
    }
