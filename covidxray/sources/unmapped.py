"""Findings a source could not map to a label, and the config that would map them.

An adapter drops a row whose finding neither its descriptor nor
`data.label_overrides` knows with `unknown_finding`; prepare then tells the
user which findings those were, how often, and the exact YAML and --set lines
that would map them (the label is the user's decision, so it is left as LABEL).
"""

from __future__ import annotations

import json
import shlex
from collections import Counter
from collections.abc import Iterable

from covidxray.records import HARMONISED_LABELS, Dropped

UNKNOWN_FINDING = "unknown finding"
PLACEHOLDER = "LABEL"


def unknown_finding(finding: str, where: str) -> Dropped:
    """The drop of a row whose finding has no label; the finding itself travels in `detail`."""
    return Dropped(f"{UNKNOWN_FINDING} {finding!r}", where, finding)


def unmapped_findings(dropped: Iterable[tuple[str, Dropped]]) -> Counter[str]:
    """Finding -> rows dropped for it, over all sources, most frequent first when iterated with most_common."""
    return Counter(item.detail for _source, item in dropped if item.reason.startswith(UNKNOWN_FINDING) and item.detail)


def override_hint(dropped: Iterable[tuple[str, Dropped]]) -> list[str]:
    """Lines telling which findings were not mapped and how to map them; empty when all were."""
    counts = unmapped_findings(dropped)
    if not counts:
        return []
    findings = [finding for finding, _ in counts.most_common()]
    # JSON strings are YAML double-quoted strings: spaces, commas, dots and slashes in findings stay intact.
    mapping = "{" + ", ".join(f"{json.dumps(f, ensure_ascii=False)}: {PLACEHOLDER}" for f in findings) + "}"
    lines = [f"{sum(counts.values())} row(s) dropped because their finding maps to no label:"]
    lines += [f"  {n:5d} x {finding!r}" for finding, n in counts.most_common()]
    lines += [
        f"to use them, replace {PLACEHOLDER} with one of {', '.join(HARMONISED_LABELS)} (leave out findings to keep dropped) in either",
        f"  config file, under data:   label_overrides: {mapping}",
        f"  command line:              --set {shlex.quote('data.label_overrides=' + mapping)}",
    ]
    return lines
