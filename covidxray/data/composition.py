"""Where each class comes from: the source x class table of a prepared set and its shortcut warnings.

Public chest X-ray collections differ in more than disease: the Kaggle/Kermany
pneumonia images are children from one hospital, the COVID images adults'
figures from papers, the talo normals NIH adults. When a class comes almost
entirely from one collection, a model can learn the collection (age, hospital,
scanner, figure style) instead of the disease and still score well on a split of
the same merge (DeGrave et al. 2021; docs/datasets.md). Prepare cannot fix that,
but it can say so before anyone trains.
"""

from __future__ import annotations

from collections import Counter

from covidxray.manifest import Manifest

# What sets each public source apart besides the disease: the shortcut a model can learn instead.
SOURCE_TRAITS = {
    "chest-xray-pneumonia": "children aged 1-5 from one hospital in Guangzhou",
    "kermany": "children aged 1-5 from one hospital in Guangzhou",
    "covid-chestxray": "adults, many images cropped from papers and websites with arrows and text",
    "covid19-talo": "NIH ChestX-ray14 adults as 1024 px PNGs beside re-cropped COVID figures",
    "synthetic": "generated phantoms",
}


def _trait(source: str) -> str:
    return f" ({SOURCE_TRAITS[source]})" if source in SOURCE_TRAITS else ""


def source_class_totals(splits: dict[str, dict], classes: list[str]) -> dict[str, dict[str, int]]:
    """Source -> class -> images over all splits, from the per-split `source_classes` of the manifest."""
    totals: dict[str, Counter] = {}
    for info in splits.values():
        for source, counts in info["source_classes"].items():
            totals.setdefault(source, Counter()).update(counts)
    return {source: {c: totals[source].get(c, 0) for c in classes} for source in sorted(totals)}


def shortcut_warnings(totals: dict[str, dict[str, int]], classes: list[str], share: float) -> list[str]:
    """One sentence per class that comes mostly (>= `share`) from one source, and per source that holds one class only.

    A set with a single source has nothing to confuse the disease with, so it never warns.
    """
    if len(totals) < 2:
        return []
    warnings = []
    for cls in classes:
        per_source = {source: counts[cls] for source, counts in totals.items()}
        total = sum(per_source.values())
        top = max(per_source, key=lambda s: (per_source[s], s))
        if total and per_source[top] / total >= share:
            warnings.append(
                f"class {cls!r}: {per_source[top] / total:.0%} of its {total} images come from {top}{_trait(top)}; "
                f"a model can learn that source's look (age, hospital, figure style) instead of {cls} and still score "
                f"well on a split of this merge: check `covidxray evaluate`'s per-source metrics, or hold a source out"
            )
    for source, counts in totals.items():
        present = [c for c in classes if counts[c]]
        if len(present) == 1 and len(classes) > 1:
            warnings.append(
                f"source {source!r} holds only {present[0]} images{_trait(source)}: whatever marks this source "
                f"(age, hospital, figure style) is a perfect cue for {present[0]} in every split"
            )
    return warnings


def composition(splits: dict[str, dict], classes: list[str], share: float) -> dict:
    """The manifest's `composition`: totals over all splits and the warnings they raise."""
    totals = source_class_totals(splits, classes)
    return {
        "source_classes": totals,
        "shortcut_warning_share": share,
        "warnings": shortcut_warnings(totals, classes, share),
    }


def table_lines(manifest: Manifest) -> list[str]:
    """The source x class table of every split, as aligned text lines for the console."""
    classes = manifest.labels
    sources = sorted({s for info in manifest.splits.values() for s in info.source_classes})
    width = max([len(s) for s in sources] + [6])
    columns = [max(len(c), 6) for c in classes]
    header = f"{'split':5s} {'source':{width}s} " + " ".join(f"{c:>{w}s}" for c, w in zip(classes, columns))
    lines = ["images per source and class:", header]
    for split, info in manifest.splits.items():
        for source, counts in info.source_classes.items():
            lines.append(
                f"{split:5s} {source:{width}s} " + " ".join(f"{counts[c]:{w}d}" for c, w in zip(classes, columns))
            )
    return lines
