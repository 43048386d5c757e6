"""The README's table of latest benchmark figures, made from the reports in docs/bench, never typed by hand.

Each row is one report: the goals its benchmark checked, what it measured against each target, and the commit
and date it ran at. So the README cannot quote a figure no report holds, and a report the code has moved past is
flagged by scripts/stale_benchmarks.py like any other. Why a goal is missed, and every earlier run, is in
docs/benchmarks.md.

    python scripts/summarize_benchmarks.py            # print the table
    python scripts/summarize_benchmarks.py --write    # put it into README.md between the two markers

tests/test_bench_fresh.py fails when README.md's table is not this script's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stale_benchmarks import REPO, REPORTS

README = REPO / "README.md"
BEGIN = "<!-- made by scripts/summarize_benchmarks.py from docs/bench: do not edit by hand -->"
END = "<!-- end of scripts/summarize_benchmarks.py's table -->"

# The report that answers each question a user asks, in the order of the product's stages; §N is the section of
# docs/benchmarks.md that explains it. Variants and earlier runs stay in docs/bench and docs/benchmarks.md.
HEADLINES = (
    ("prepare.json", "prepare, 400 phantoms of 1024 px (§1)"),
    ("prepare-ieee8023.json", "prepare, the ieee8023 snapshot, ≤ 768 px (§1)"),
    ("prepare-kaggle224.json", "prepare, the Kaggle 224 px copy, 5,840 files (§1)"),
    ("prepare-scale.json", "prepare --scale, 1k to 20k phantoms (§1)"),
    ("dedup.json", "near-duplicates: 136 originals × 8 kinds of copy, 1,500 real films (§7)"),
    ("dedup-20k.json", "near-duplicates, 20,000 images (§7)"),
    ("input.json", "training input pipeline (§2)"),
    ("horovod.json", "Horovod, 2 ranks against 1 (§3)"),
    ("step.json", "one rank's training step, x86-64 and emulated arm64 (§11)"),
    ("quality-kaggle-lite0-frozen-stages-4.json", "Kaggle official test folder, the Pi-cluster recipe (§6 d)"),
    ("quality-kaggle-pneumonia-30ep.json", "Kaggle official test folder, mobilenet_v3_small from scratch (§6 a)"),
    ("quality-chest3-full-lite0.json", "three classes, the full collections, the Pi-cluster recipe (§6)"),
    ("quality-loso-lite0-baseline.json", "one collection held out, trained on the other two (§8)"),
    ("allreduce-1gbe-idle.json", "allreduce of 8 emulated ranks, 1 GbE (§5)"),
    ("overlap-side-by-side.json", "35 boards predicted from 2 real ones, 1 GbE, 1 ms cycle (§5)"),
    ("overlap-cycle25-side-by-side.json", "the same, 25 ms cycle (§5)"),
    ("predict.json", "predict, small_cnn (§4)"),
    ("predict-efficientnet_lite0.json", "predict, the Pi-cluster model (§4)"),
    ("gate.json", "input gate, small_cnn three-class run (docs/deploy.md)"),
    ("gate-efficientnet_lite0.json", "input gate, the Pi-cluster model (docs/deploy.md)"),
    ("serve.json", "covidxray serve, 8 clients (§10)"),
    ("tensorboard.json", "TensorBoard and covidxray report (§9)"),
)


def figure(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def goal_text(goal: dict) -> str:
    text = f"{goal['goal']}: {figure(goal['measured'])} ({goal['target']})"
    return text if goal["met"] else f"**{text}**"


def row(repo: Path, report: str, what: str) -> str:
    data = json.loads((repo / REPORTS / report).read_text())
    goals = data["goals"]
    met = sum(goal["met"] for goal in goals)
    ran = f"{data['environment']['git_commit'][:7]}, {data['date'][:10]}"
    figures = "; ".join(goal_text(goal) for goal in goals)
    return f"| [{what}]({REPORTS / report}) | {ran} | {met} of {len(goals)} | {figures} |"


def table(repo: Path = REPO) -> str:
    lines = [
        "| what | ran at | goals met | each goal: measured (target); missed in bold |",
        "|---|---|---|---|",
        *(row(repo, report, what) for report, what in HEADLINES),
    ]
    return "\n".join(lines)


def readme_table(readme: str) -> str | None:
    """The table between the markers of README.md's text; None when the markers are missing."""
    if BEGIN not in readme or END not in readme:
        return None
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="put the table into README.md between its markers")
    args = parser.parse_args()
    made = table()
    if not args.write:
        print(made)
        return
    readme = README.read_text()
    if readme_table(readme) is None:
        sys.exit(f"{README} lacks the markers {BEGIN!r} and {END!r}: put them where the table goes")
    before, rest = readme.split(BEGIN, 1)
    README.write_text(f"{before}{BEGIN}\n{made}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
