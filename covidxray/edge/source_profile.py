"""Does this image look like any collection the model was trained on? A warning, not a rejection.

A model's figures hold for films like its training sources' (docs/datasets.md,
"Source bias"): a film from another hospital, scanner or population may be
classified worse than any test split showed (docs/benchmarks.md, the
leave-one-source-out table). So predict says when an image looks unlike every
training source, and still answers: the film is a chest radiograph (the gate,
the out-of-distribution and layout checks passed), but the clinic should know
it lies outside what the model was validated on.

The profile, fitted at export (covidxray/export/source_profile.py) and carried
in the sidecar: each training source's mean embedding (the model's penultimate
features, the `embedding` output) and one Ledoit-Wolf shrunk covariance of the
embeddings around their source's mean, from the train split; each source's
limit is the largest distance of that source's val images to its mean, times
`export.source_margin`. An image's ratio to a source is its Mahalanobis
distance to that source's mean over that source's limit; above 1 for every
source, predict adds the warning. numpy only: predict on a board imports this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from covidxray.edge.sidecar_arrays import pack, unpack
from covidxray.sidecar import Sidecar

SIDECAR_KEY = "source_profile"
METHOD = (
    "Mahalanobis distance of the embedding to each training source's mean (shared Ledoit-Wolf covariance, train "
    "split) over that source's limit (its val images' largest distance x export.source_margin)"
)


@dataclass
class SourceProfile:
    sources: list[str]
    means: np.ndarray  # (sources, dim)
    precision: np.ndarray  # (dim, dim)
    limits: np.ndarray  # (sources,)

    def distances(self, embeddings: np.ndarray) -> np.ndarray:
        """(n, sources): each embedding's Mahalanobis distance to each source's mean."""
        centred = np.asarray(embeddings, np.float64)[:, None, :] - self.means[None]
        return np.sqrt(np.maximum(np.einsum("nsd,de,nse->ns", centred, self.precision, centred), 0.0))

    def ratios(self, embeddings: np.ndarray) -> np.ndarray:
        """(n, sources): distance over the source's limit; above 1 = unlike that source's training images."""
        return self.distances(embeddings) / self.limits[None]

    def unlike_every_source(self, embeddings: np.ndarray) -> np.ndarray:
        """(n,) bool: the image is beyond every source's limit."""
        return self.ratios(embeddings).min(axis=1) > 1.0

    def assess(self, embedding: np.ndarray) -> dict:
        """One image's entry in predict's answer: the nearest source, its ratio, and the warning when there is one."""
        ratios = self.ratios(np.asarray(embedding)[None])[0]
        nearest = int(ratios.argmin())
        entry = {"nearest_source": self.sources[nearest], "ratio": float(ratios[nearest])}
        if ratios[nearest] > 1.0:
            entry["warning"] = (
                f"looks unlike every training source (nearest: {self.sources[nearest]}, {ratios[nearest]:.2f}x the "
                "distance of its farthest validation image): outside what the model was validated on, read the "
                "answer with care"
            )
        return entry

    def to_sidecar(self, extra: dict) -> dict:
        count, dim = self.means.shape
        return {
            "method": METHOD,
            "sources": list(self.sources),
            "dim": dim,
            "limits": [float(v) for v in self.limits],
            **extra,
            "means": pack(self.means),
            "precision": pack(self.precision),
        }

    @classmethod
    def from_sidecar(cls, entry: dict) -> SourceProfile:
        """KeyError/TypeError/ValueError when the entry is damaged."""
        sources, dim = [str(s) for s in entry["sources"]], int(entry["dim"])
        limits = np.asarray(entry["limits"], np.float64)
        if len(limits) != len(sources) or not sources or not np.all(limits > 0):
            raise ValueError(f"{len(sources)} sources with limits {entry['limits']}")
        return cls(sources, unpack(entry["means"], (len(sources), dim)), unpack(entry["precision"], (dim, dim)), limits)


def from_card(card: Sidecar) -> SourceProfile | None:
    """The sidecar's profile, None for a sidecar exported without one; ValueError naming the damage."""
    if card.source_profile is None:
        return None
    try:
        return SourceProfile.from_sidecar(card.source_profile)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"source-profile section is damaged ({type(err).__name__}: {err})") from None
