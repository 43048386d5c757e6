"""Whether two `covidxray predict --json` documents for the same files give the same answers, as two installs
must (scripts/edge_check.sh: the training venv's and an edge venv's on another Python, numpy or machine).

    python scripts/same_predictions.py EXPECTED.json ACTUAL.json [--tolerance 1e-5]

Entries are paired in order (the files may sit at other paths in the other install). The same: the class, every
probability within the tolerance, the same rejection reason with its score within the tolerance (relative for
scores above 1, such as out-of-distribution distances), the same error reason. Prints each difference and exits
1 if there is one; stdlib only, so any Python runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def close(expected: float, actual: float, tolerance: float) -> bool:
    return math.isclose(expected, actual, rel_tol=tolerance, abs_tol=tolerance)


def entry_differences(expected: dict, actual: dict, tolerance: float) -> list[str]:
    if "error" in expected or "error" in actual:
        same = expected.get("reason") == actual.get("reason") and ("error" in expected) == ("error" in actual)
        return [] if same else [f"error {expected.get('reason')!r} vs {actual.get('reason')!r}"]
    if "rejected" in expected or "rejected" in actual:
        if expected.get("reason") != actual.get("reason") or ("rejected" in expected) != ("rejected" in actual):
            return [
                f"verdict {expected.get('reason', expected.get('label'))!r} vs {actual.get('reason', actual.get('label'))!r}"
            ]
        if not close(expected["score"], actual["score"], tolerance):
            return [f"{expected['reason']} score {expected['score']!r} vs {actual['score']!r}"]
        return []
    if expected["label"] != actual["label"] or expected["probabilities"].keys() != actual["probabilities"].keys():
        return [f"class {expected['label']!r} vs {actual['label']!r}"]
    return [
        f"p({name}) {p!r} vs {actual['probabilities'][name]!r}"
        for name, p in expected["probabilities"].items()
        if not close(p, actual["probabilities"][name], tolerance)
    ]


def differences(expected: list[dict], actual: list[dict], tolerance: float) -> list[str]:
    if len(expected) != len(actual):
        return [f"{len(expected)} entries vs {len(actual)}"]
    return [
        f"{want['file']}: {problem}"
        for want, got in zip(expected, actual)
        for problem in entry_differences(want, got, tolerance)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("expected")
    parser.add_argument("actual")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    with open(args.expected) as handle:
        expected = json.load(handle)
    with open(args.actual) as handle:
        actual = json.load(handle)
    found = differences(expected, actual, args.tolerance)
    for line in found:
        print(line)
    kinds = [("error" in e and "error") or ("rejected" in e and e["reason"]) or "classified" for e in expected]
    summary = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
    print(f"{'DIFFERENT' if found else 'same'}: {len(expected)} files ({summary}), tolerance {args.tolerance:g}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
