"""Dataset descriptors: what `datasets/<name>.yaml` says about a public collection.

A descriptor is the one place that states where a collection lives (archive
URLs and, where known, their sha256), under which licence, how its own
findings map onto the harmonised labels, and which adapter reads it. Adapters
read their label map from here instead of hard-coding it, so a new finding
string is a one-line YAML change.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from covidxray.errors import UserError
from covidxray.records import HARMONISED_LABELS

DESCRIPTOR_DIR = Path(__file__).resolve().parents[1] / "datasets"  # symlink to the top-level datasets/ in a checkout
UNKNOWN = "unknown"
DEFAULT_DEDUP_PRIORITY = 100  # sources without a descriptor (e.g. synthetic) lose ties to described ones
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Archive:
    """One downloadable file of a collection; `url`/`sha256` are None when not known."""

    key: str
    file: str
    url: str | None
    sha256: str | None
    note: str = ""


def normalise_finding(text: str) -> str:
    """Case, spacing and hierarchy separators normalised: ' Pneumonia / Viral/Herpes ' -> 'pneumonia/viral/herpes'."""
    return "/".join(part.strip().casefold() for part in str(text).split("/")).strip("/")


@dataclass(frozen=True)
class Descriptor:
    name: str
    title: str
    homepage: str
    licence: str
    dedup_priority: int
    archives: dict[str, Archive]
    label_map: dict[str, str]  # normalised finding -> harmonised label
    unlabelled: frozenset[str] = field(default_factory=frozenset)  # findings that mean "not labelled yet"
    excluded: dict[str, str] = field(default_factory=dict)  # normalised finding -> why it is deliberately not used
    layout: str = ""
    citation: str = ""
    kaggle_dataset: str = ""  # owner/slug when the collection is fetched through the Kaggle API
    overrides: dict[str, str] = field(default_factory=dict)  # normalised finding -> label, from data.label_overrides

    def with_overrides(self, overrides: Mapping[str, str]) -> Descriptor:
        """This descriptor with the user's finding -> label mappings, which win over label_map and excluded."""
        return dataclasses.replace(self, overrides={normalise_finding(f): label for f, label in overrides.items()})

    def archive(self, key: str) -> Archive:
        try:
            return self.archives[key]
        except KeyError:
            raise UserError(
                f"datasets/{self.name}.yaml has no archive {key!r}; it lists {', '.join(self.archives)}"
            ) from None

    def is_unlabelled(self, finding: str) -> bool:
        return normalise_finding(finding) in self.unlabelled

    def exclusion(self, finding: str) -> str | None:
        """Why the descriptor deliberately leaves this finding unmapped, or None."""
        return self.excluded.get(normalise_finding(finding))

    def label_for(self, finding: str) -> str | None:
        """Harmonised label of a source finding, or None when neither the overrides nor the map know it.

        A finding listed whole wins ('COVID-19, ARDS'). Hierarchical findings fall
        back to their nearest mapped ancestor ('Pneumonia/Viral/Herpes' ->
        'pneumonia/viral'). Other comma lists take the label their mapped parts
        agree on.
        """
        whole = self._exact(normalise_finding(finding))
        if whole is not None:
            return whole
        labels = {label for part in str(finding).split(",") if (label := self._lookup(part)) is not None}
        return labels.pop() if len(labels) == 1 else None

    def _lookup(self, finding: str) -> str | None:
        parts = normalise_finding(finding).split("/")
        while parts and parts[0]:
            label = self._exact("/".join(parts))
            if label is not None:
                return label
            parts.pop()
        return None

    def _exact(self, key: str) -> str | None:
        return self.overrides.get(key) or self.label_map.get(key)


def _archive(name: str, key: str, raw: dict) -> Archive:
    where = f"datasets/{name}.yaml archives.{key}"
    if not isinstance(raw, dict) or "file" not in raw:
        raise UserError(f"{where}: needs at least `file:` (and `url:`, `sha256:`; write 'unknown' when not known)")
    sha = str(raw.get("sha256", UNKNOWN)).strip().lower()
    if sha != UNKNOWN and not _SHA256.match(sha):
        raise UserError(f"{where}: sha256 {sha!r} is neither 64 hex digits nor 'unknown'")
    url = str(raw.get("url", UNKNOWN)).strip()
    return Archive(
        key,
        str(raw["file"]),
        None if url == UNKNOWN else url,
        None if sha == UNKNOWN else sha,
        str(raw.get("note", "")).strip(),
    )


_KEYS = {
    "name",
    "title",
    "homepage",
    "licence",
    "citation",
    "dedup_priority",
    "kaggle_dataset",
    "archives",
    "label_map",
    "unlabelled",
    "excluded",
    "layout",
}


def parse_descriptor(name: str, raw: dict) -> Descriptor:
    where = f"datasets/{name}.yaml"
    if not isinstance(raw, dict) or raw.get("name") != name:
        raise UserError(f"{where}: expected a mapping whose `name:` is {name!r}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_KEYS))}")
    label_map = {}
    for finding, label in (raw.get("label_map") or {}).items():
        if label not in HARMONISED_LABELS:
            raise UserError(
                f"{where}: label_map maps {finding!r} to {label!r}, which is not one of {', '.join(HARMONISED_LABELS)}"
            )
        label_map[normalise_finding(finding)] = label
    excluded = {normalise_finding(finding): str(why).strip() for finding, why in (raw.get("excluded") or {}).items()}
    both = sorted(set(excluded) & set(label_map))
    if both:
        raise UserError(f"{where}: {', '.join(both)} both mapped in label_map and listed in excluded; keep one")
    return Descriptor(
        name=name,
        title=str(raw.get("title", name)),
        homepage=str(raw.get("homepage", "")),
        licence=str(raw.get("licence", UNKNOWN)).strip(),
        dedup_priority=int(raw.get("dedup_priority", DEFAULT_DEDUP_PRIORITY)),
        archives={key: _archive(name, key, value) for key, value in (raw.get("archives") or {}).items()},
        label_map=label_map,
        unlabelled=frozenset(normalise_finding(f) for f in raw.get("unlabelled") or ()),
        excluded=excluded,
        layout=str(raw.get("layout", "")).strip(),
        citation=str(raw.get("citation", "")).strip(),
        kaggle_dataset=str(raw.get("kaggle_dataset", "")).strip(),
    )


@cache
def load_descriptor(name: str) -> Descriptor:
    path = DESCRIPTOR_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(
            f"no descriptor {path} for source {name!r}: the installed covidxray lacks its datasets/ descriptors; reinstall it from a full checkout"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML: {err}") from None
    return parse_descriptor(name, raw)


def dedup_priority(source: str) -> int:
    """Lower wins when the same image is in several sources; originals rank before re-packagings."""
    path = DESCRIPTOR_DIR / f"{source}.yaml"
    return load_descriptor(source).dedup_priority if path.is_file() else DEFAULT_DEDUP_PRIORITY
