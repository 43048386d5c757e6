"""docs/bench reports describe the code as it is: none is stale unless docs/bench/known_stale.toml says why.

The check (scripts/stale_benchmarks.py) is first run on throwaway git
repositories whose history is known, then on this repository's reports.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_prepared_via import module_file

sys.path.insert(0, str(REPO / "scripts"))
import stale_benchmarks  # noqa: E402

FAKE_BENCH = '''"""A benchmark of pkg."""
MEASURES = ("pkg/measured.py", "pkg/sub")
'''
# the same benchmark, pkg/sub reaching its figures only through the data its prepare step writes
PREPARED_BENCH = FAKE_BENCH + 'PREPARED_VIA = ("pkg/sub",)\n'
FAKE_COMMAND = ".venv/bin/python scripts/bench_fake.py --out /tmp/x/fake.json"


def git(repo, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def commit_all(repo, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "--short", "HEAD")


def write(repo, path: str, text: str) -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)


def write_report(repo, commit: str, command: str = FAKE_COMMAND):
    report = {"benchmark": "fake", "command": command, "environment": {"git_commit": commit}}
    write(repo, "docs/bench/fake.json", json.dumps(report))


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with a benchmark of pkg/measured.py and pkg/sub/, and pkg/other.py it does not measure."""
    for variable in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(variable, "bench")
    for variable in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(variable, "bench@example.invalid")
    git(tmp_path, "init", "-q", "-b", "main")
    write(tmp_path, "scripts/bench_fake.py", FAKE_BENCH)
    for path in ("pkg/measured.py", "pkg/other.py", "pkg/sub/inner.py"):
        write(tmp_path, path, "VALUE = 1\n")
    return tmp_path


def stale(repo) -> dict[str, tuple[str, ...]]:
    return {item.report: item.changed for item in stale_benchmarks.stale_reports(repo)}


def test_a_report_goes_stale_when_a_measured_file_changes(repo):
    measured_at = commit_all(repo, "code")
    write_report(repo, measured_at)
    commit_all(repo, "report")
    assert stale(repo) == {}
    write(repo, "pkg/other.py", "VALUE = 2\n")
    commit_all(repo, "code the benchmark does not measure")
    assert stale(repo) == {}
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")  # a file in a declared folder: not committed yet
    assert stale(repo) == {"fake.json": ("pkg/sub/inner.py",)}
    commit_all(repo, "measured code")
    write(repo, "pkg/measured.py", "VALUE = 2\n")
    assert stale(repo) == {"fake.json": ("pkg/measured.py", "pkg/sub/inner.py")}
    write_report(repo, commit_all(repo, "more measured code"))  # the benchmark re-run
    assert stale(repo) == {}
    write(repo, "pkg/measured.py", "# why it is 2\nVALUE = (\n    2\n)\n")
    assert stale(repo) == {}  # formatting and comments: the same code
    write(repo, "pkg/measured.py", "VALUE = (2\n")
    write_report(repo, commit_all(repo, "code that does not parse"))
    assert stale(repo) == {}
    write(repo, "pkg/measured.py", "VALUE = (3\n")  # no syntax tree to compare: any change counts
    assert stale(repo) == {"fake.json": ("pkg/measured.py",)}
    (repo / "pkg/sub/inner.py").unlink()
    assert stale(repo) == {"fake.json": ("pkg/measured.py", "pkg/sub/inner.py")}


def test_a_yaml_config_counts_as_changed_only_when_its_data_does(repo):
    write(repo, "scripts/bench_fake.py", FAKE_BENCH.replace('"pkg/sub")', '"pkg/sub", "configs/fake.yaml")'))
    write(repo, "configs/fake.yaml", "train:\n  epochs: 60  # measured: 0.971\n")
    write_report(repo, commit_all(repo, "a benchmark of a config"))
    write(repo, "configs/fake.yaml", "train:\n  # measured twice: 0.971, then 0.962\n  epochs:   60\n")
    assert stale(repo) == {}  # comments and layout: the same settings
    write(repo, "configs/fake.yaml", "train:\n  epochs: '60'\n")
    assert stale(repo) == {"fake.json": ("configs/fake.yaml",)}  # a string is not the number
    write(repo, "configs/fake.yaml", "train: [\n")
    assert stale(repo) == {"fake.json": ("configs/fake.yaml",)}  # no data to compare: any change counts


EPOCHS = "    epochs: int = setting(10, low=1, high=100)\n"
FORMATS = '    formats: list = field(default_factory=lambda: ["float32"])\n'
SETTINGS = f"""from dataclasses import dataclass, field

from strict import setting


@dataclass
class TrainConfig:
{EPOCHS}{FORMATS}

def load():
    return TrainConfig()
"""


@pytest.mark.parametrize(
    ("edit", "is_stale"),
    [
        (("high=100)", "high=1000)"), False),  # a wider range: every command that ran before runs the same
        (("low=1, high=100", "choices=(10, 20)"), False),
        (('["float32"])\n', '["float32"])\n    batch: int = setting(32, low=1)\n'), False),  # a new setting
        (("setting(10,", "setting(12,"), True),  # a default
        (('["float32"]', '["int8"]'), True),
        (("epochs: int", "epochs: float"), True),
        (("    epochs: int = setting(10, low=1, high=100)\n", ""), True),  # a setting removed
        (  # the same settings in another order: a positional TrainConfig(...) means something else
            (EPOCHS + FORMATS, FORMATS + EPOCHS),
            True,
        ),
        (("return TrainConfig()", "return TrainConfig(epochs=3)"), True),  # code besides the fields
    ],
)
def test_a_settings_module_counts_as_changed_when_a_default_does_not_when_a_range_or_new_setting_does(
    repo, edit, is_stale
):
    """covidxray/config.py is measured by every benchmark for its defaults; a setting added for a new feature or
    a range widened must not make every report stale, a changed default must."""
    write(repo, "pkg/measured.py", SETTINGS)
    write_report(repo, commit_all(repo, "settings"))
    write(repo, "pkg/measured.py", SETTINGS.replace(*edit))
    assert stale(repo) == ({"fake.json": ("pkg/measured.py",)} if is_stale else {})


def test_a_report_from_a_branch_is_judged_by_what_it_measured(repo):
    commit_all(repo, "code")
    git(repo, "switch", "-q", "-c", "faster")
    write(repo, "pkg/measured.py", "VALUE = 2\n")
    measured_on_branch = commit_all(repo, "faster code")
    git(repo, "switch", "-q", "main")
    write(repo, "pkg/measured.py", "VALUE = 2\n")  # the branch landed as one squashed commit, not merged
    write_report(repo, measured_on_branch)
    commit_all(repo, "squashed: faster code and its report")
    not_an_ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", measured_on_branch, "HEAD"], cwd=repo)
    assert not_an_ancestor.returncode == 1
    assert stale(repo) == {}
    write(repo, "pkg/measured.py", "VALUE = 3\n")
    commit_all(repo, "main changed it again")
    assert stale(repo) == {"fake.json": ("pkg/measured.py",)}


@pytest.mark.parametrize("commit", ["", "0123abc", "not-a-commit"])
def test_a_report_with_a_missing_or_unknown_commit_is_stale(repo, commit):
    commit_all(repo, "code")
    write_report(repo, commit)
    [item] = stale_benchmarks.stale_reports(repo)
    assert (item.report, item.commit, item.changed) == ("fake.json", commit, ())
    assert ("records no git commit" if not commit else f"its commit {commit!r} is unknown") in item.line()


def test_the_stale_line_names_the_benchmark_and_the_command_to_rerun(repo):
    commit_all(repo, "code")
    write_report(repo, "0123abc", "/venv/bin/python /elsewhere/wt/scripts/bench_fake.py --repeats 3 --out /tmp/r.json")
    [item] = stale_benchmarks.stale_reports(repo)
    assert item.rerun == "/venv/bin/python scripts/bench_fake.py --repeats 3 --out docs/bench/fake.json"
    assert item.line().startswith("fake.json (bench_fake) is stale")
    assert item.line().endswith(f"re-run: {item.rerun}")


def write_revalidation(repo, old: str, new: str, command: str = FAKE_COMMAND) -> None:
    """What scripts/revalidate_prepared.py appends once every prepare wrote the same data at `old` and `new`."""
    record = {"from": old, "to": new, "command": command, "digests": ["0" * 64]}
    with open(repo / stale_benchmarks.REVALIDATED, "a") as handle:
        handle.write(stale_benchmarks.revalidation_toml("fake.json", record))


def revalidated(repo) -> dict[str, list[tuple[str, str]]]:
    _, fresh_through = stale_benchmarks.assess_reports(repo)
    return {item.report: [(r["from"], r["to"]) for r in item.chain] for item in fresh_through}


@pytest.fixture
def measured(repo) -> str:
    """The commit a report of the benchmark with PREPARED_VIA (pkg/sub) was measured at, committed with it."""
    write(repo, "scripts/bench_fake.py", PREPARED_BENCH)
    commit = commit_all(repo, "code")
    write_report(repo, commit)
    commit_all(repo, "report")
    return commit


def test_a_change_within_prepared_via_is_fresh_through_a_revalidation_record(repo, measured):
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")
    faster = commit_all(repo, "faster prepare, the same data")
    assert stale(repo) == {"fake.json": ("pkg/sub/inner.py",)}  # no record: stale
    write_revalidation(repo, measured, faster, command="scripts/bench_fake.py --another-recipe")
    assert stale(repo) == {"fake.json": ("pkg/sub/inner.py",)}  # a record of another command vouches for nothing
    write_revalidation(repo, measured, faster)
    assert stale(repo) == {}
    assert revalidated(repo) == {"fake.json": [(measured, faster)]}
    [item] = stale_benchmarks.assess_reports(repo)[1]
    assert item.line().startswith(f"fake.json (bench_fake) measured at {measured} is fresh through revalidation")
    write(repo, "pkg/sub/inner.py", "# why\nVALUE = (\n    2\n)\n")
    assert stale(repo) == {}  # after the record's `to`, formatting and comments still count as unchanged


def test_records_chain_from_the_report_to_the_working_tree(repo, measured):
    write(repo, "pkg/other.py", "VALUE = 2\n")
    unmeasured = commit_all(repo, "code the benchmark does not measure")
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")
    first = commit_all(repo, "faster prepare")
    write(repo, "pkg/sub/inner.py", "VALUE = 3\n")
    second = commit_all(repo, "faster still")
    write_revalidation(repo, first, second)
    assert set(stale(repo)) == {"fake.json"}  # nothing carries the report from its commit to `first`
    write_revalidation(repo, unmeasured, first)  # `from` has the report's tree: the chain holds
    assert stale(repo) == {}
    assert revalidated(repo) == {"fake.json": [(unmeasured, first), (first, second)]}


def test_a_change_outside_prepared_via_is_stale_despite_a_record(repo, measured):
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")
    write(repo, "pkg/measured.py", "VALUE = 2\n")  # reaches the figures other than through prepared data
    both = commit_all(repo, "faster prepare and a measured change")
    write_revalidation(repo, measured, both)
    assert stale(repo) == {"fake.json": ("pkg/measured.py", "pkg/sub/inner.py")}
    assert revalidated(repo) == {}


def test_a_change_after_the_records_to_is_stale(repo, measured):
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")
    faster = commit_all(repo, "faster prepare")
    write_revalidation(repo, measured, faster)
    assert stale(repo) == {}
    write(repo, "pkg/sub/inner.py", "VALUE = 3\n")  # within PREPARED_VIA, but no record shows the same data
    assert stale(repo) == {"fake.json": ("pkg/sub/inner.py",)}
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")
    write(repo, "pkg/measured.py", "VALUE = 2\n")
    assert stale(repo) == {"fake.json": ("pkg/measured.py", "pkg/sub/inner.py")}


def test_a_record_from_another_tree_than_the_reports_is_stale(repo, measured):
    write(repo, "pkg/measured.py", "VALUE = 2\n")
    elsewhere = commit_all(repo, "a measured change after the report")
    write(repo, "pkg/sub/inner.py", "VALUE = 2\n")
    faster = commit_all(repo, "faster prepare")
    write_revalidation(repo, elsewhere, faster)  # its `from` is not the code the report measured
    assert stale(repo) == {"fake.json": ("pkg/measured.py", "pkg/sub/inner.py")}
    write_revalidation(repo, "0123abc", faster)  # nor is an unknown commit
    assert set(stale(repo)) == {"fake.json"}


def test_prepared_via_outside_measures_is_refused(repo):
    write(repo, "scripts/bench_fake.py", FAKE_BENCH + 'PREPARED_VIA = ("pkg/other.py",)\n')
    commit = commit_all(repo, "code")
    write(repo, "pkg/measured.py", "VALUE = 2\n")
    write_report(repo, commit)
    with pytest.raises(ValueError, match="PREPARED_VIA names pkg/other.py, which MEASURES does not cover"):
        stale_benchmarks.stale_reports(repo)


def test_a_bench_without_measures_is_refused(repo):
    write(repo, "scripts/bench_fake.py", '"""A benchmark that forgot."""\nOTHER = ("pkg",)\n')
    write_report(repo, commit_all(repo, "code"))
    with pytest.raises(ValueError, match="bench_fake.py declares no MEASURES"):
        stale_benchmarks.stale_reports(repo)


def test_outside_a_checkout_staleness_cannot_be_told(repo, tmp_path_factory):
    commit_all(repo, "code")
    assert stale_benchmarks.is_checkout(repo)
    assert not stale_benchmarks.is_checkout(repo / "pkg")  # a source tarball unpacked inside another checkout
    assert not stale_benchmarks.is_checkout(tmp_path_factory.mktemp("tarball"))


def test_every_benchmark_declares_paths_that_exist():
    scripts = sorted((REPO / "scripts").glob("bench_*.py"))
    assert scripts
    for script in scripts:
        declared = stale_benchmarks.declared_measures(script) + stale_benchmarks.declared_prepared_via(script)
        for path in declared:
            assert (REPO / path).exists(), f"{script.name} declares {path}, which does not exist"


def covidxray_imports(path: Path) -> set[Path]:
    """The covidxray modules (and their packages) `path` imports anywhere in it, as files of this repository."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    files = set()
    for name in names:
        parts = name.split(".")
        for end in range(1, len(parts) + 1) if parts[0] == "covidxray" else ():
            files.update(filter(None, [module_file(REPO, ".".join(parts[:end]))]))
    return files


# Modules every stage goes through to decide what it reads and runs with: the defaults of all a run is not told
# (the dedup thresholds, the image size, the learning rate) and how each value is read and checked, which model,
# source or task a name means, which shards of which split a run reads, a record's fields and labels.
SHARED = [
    "covidxray/config.py",
    "covidxray/strict.py",
    "covidxray/registry.py",
    "covidxray/manifest.py",
    "covidxray/records.py",
]


@pytest.mark.parametrize("shared", SHARED)
def test_every_benchmark_declares_the_shared_modules_it_reaches(shared):
    """A benchmark whose script or measured code imports one of SHARED, directly or not, declares it, or a changed
    default (say) would leave its reports fresh."""
    for script in sorted((REPO / "scripts").glob("bench_*.py")):
        measures = stale_benchmarks.declared_measures(script)
        measured = {
            f for path in measures for f in ([REPO / path] if path.endswith(".py") else (REPO / path).rglob("*.py"))
        }
        todo, reached = [script, *measured], set()
        while todo:
            module = todo.pop()
            if module not in reached:
                reached.add(module)
                todo.extend(covidxray_imports(module) - reached)
        if REPO / shared in reached:
            assert shared in measures, f"{script.name} reaches {shared}: declare it in MEASURES"


def test_no_report_is_stale_unless_known():
    if not stale_benchmarks.is_checkout(REPO):
        pytest.skip(f"{REPO} is not a git checkout (a source tarball?): staleness cannot be told")
    if stale_benchmarks.is_shallow(REPO):
        pytest.skip("shallow clone: the reports' commits may be missing; `git fetch --unshallow` to check them")
    known = stale_benchmarks.known_stale(REPO)
    reports = {path.name for path in (REPO / stale_benchmarks.REPORTS).glob("*.json")}
    for name, entry in known.items():
        assert name in reports, f"{stale_benchmarks.KNOWN_STALE} lists {name}, which is not a report"
        assert entry.get("reason") and entry.get("rerun_needs"), (
            f"{name}: say why it is stale and what re-running needs"
        )
    stale = stale_benchmarks.stale_reports(REPO)
    new = [item.line() for item in stale if item.report not in known]
    assert not new, "re-run these benchmarks (or list them in docs/bench/known_stale.toml with why):\n" + "\n".join(new)
    fresh_again = sorted(set(known) - {item.report for item in stale})
    assert not fresh_again, f"fresh again, remove from {stale_benchmarks.KNOWN_STALE}: {', '.join(fresh_again)}"


def test_the_readme_quotes_the_reports_as_they_are():
    """README.md's table of latest figures is scripts/summarize_benchmarks.py's output, so no figure there differs
    from the report it names; after re-running a benchmark, `python scripts/summarize_benchmarks.py --write`."""
    import summarize_benchmarks

    quoted = summarize_benchmarks.readme_table((REPO / "README.md").read_text())
    assert quoted is not None, "README.md lost summarize_benchmarks.py's markers"
    assert quoted == summarize_benchmarks.table(), (
        "README.md's figures differ from docs/bench: run scripts/summarize_benchmarks.py --write"
    )


def test_the_summary_shows_each_goal_of_a_report_and_marks_the_missed(tmp_path, monkeypatch):
    import summarize_benchmarks

    report = {
        "environment": {"git_commit": "0123456789abcdef"},
        "date": "2026-12-07T23:00:00+00:00",
        "goals": [
            {"goal": "speed-up", "met": False, "measured": 1.6213, "target": ">= 1.8", "note": ""},
            {"goal": "failed requests", "met": True, "measured": 0, "target": "<= 0", "note": ""},
        ],
    }
    write(tmp_path, "docs/bench/fake.json", json.dumps(report))
    monkeypatch.setattr(summarize_benchmarks, "HEADLINES", (("fake.json", "a fake benchmark"),))
    assert summarize_benchmarks.table(tmp_path).splitlines()[2] == (
        "| [a fake benchmark](docs/bench/fake.json) | 0123456, 2026-12-07 | 1 of 2 | "
        "**speed-up: 1.621 (>= 1.8)**; failed requests: 0 (<= 0) |"
    )


def test_the_prepares_a_leave_one_out_report_runs_are_spelled_once(tmp_path):
    """bench_quality.prepares_and_copy_checks, which the benchmark runs and scripts/revalidate_prepared.py replays."""
    import bench_quality
    import revalidate_prepared

    data_root = tmp_path / "data"
    for folder in bench_quality.FULL_COLLECTIONS.values():
        (data_root / folder).mkdir(parents=True)
    recorded = ["--recipe", "chest3-loso", "--image-size", "128", "--set", "train.degrade=0.5", "--set", "data.seed=3"]
    workdir = tmp_path / "work"
    args = bench_quality.quality_bench().parse(
        bench_quality.QUICK_DEFAULTS, [*recorded, "--workdir", str(workdir), "--data-root", str(data_root)]
    )
    commands, copy_checks = bench_quality.prepares_and_copy_checks(args)

    def option(command: list[str], name: str) -> list[str]:
        return [command[i + 1] for i, word in enumerate(command) if word == name]

    kaggle = workdir / "subsets" / "chest-xray-pneumonia-224-every3"  # every 3rd film, in training folds only
    ieee, talo = (data_root / bench_quality.FULL_COLLECTIONS[name] for name in ("covid-chestxray", "covid19-talo"))
    assert [option(c, "--source") for c in commands] == [
        [f"chest-xray-pneumonia={kaggle}", f"covid19-talo={talo}"],
        [f"covid-chestxray={ieee}"],
        [f"covid-chestxray={ieee}", f"covid19-talo={talo}"],
        [f"chest-xray-pneumonia={data_root / 'chest-xray-pneumonia-224'}"],
        [f"covid-chestxray={ieee}", f"chest-xray-pneumonia={kaggle}"],
        [f"covid19-talo={talo}"],
    ]
    assert [option(c, "--task") for c in commands] == [["pneumonia"]] * 2 + [["chest3"]] * 4
    assert all(option(c, "--set") == ["data.seed=3"] and option(c, "--image-size") == ["128"] for c in commands)
    assert [Path(option(c, "--data-dir")[0]).name for c in commands[:2]] == [
        "without-covid-chestxray-pneumonia",
        "only-covid-chestxray-pneumonia",
    ]
    # each fold's `evaluate --external` checks its held-out folder against its training folder for copies
    assert copy_checks == [tuple(Path(option(c, "--data-dir")[0]) for c in commands[i : i + 2]) for i in (0, 2, 4)]
    report = {"command": ".venv/bin/python scripts/bench_quality.py " + " ".join(recorded)}
    replayed = revalidate_prepared.recorded_run(report, workdir, data_root)
    assert replayed.prepares == commands
    assert replayed.copy_checks == [(commands[i], commands[i + 1]) for i in (0, 2, 4)]
    assert revalidate_prepared.evaluate_overrides() == []  # `evaluate --external` runs with the default data config
    report = {"command": ".venv/bin/python scripts/bench_quality.py --recipe chest3-full --image-size 128"}
    assert revalidate_prepared.recorded_run(report, workdir, data_root).copy_checks == []  # no evaluate --external


def test_train_films_picks_the_first_films_of_each_class_into_folders_of_their_own(tmp_path):
    """bench_quality --train-films N: the first N train films of each class by name, every test film, in a data
    folder apart from the recipe's own count (150); refused for a recipe that trains on whole collections, as
    --subsample is for this one."""
    import bench_quality

    data_root = tmp_path / "data"
    kaggle = data_root / "chest-xray-pneumonia-224" / "chest_xray"
    for split, count in (("train", 5), ("test", 3)):
        for cls in ("NORMAL", "PNEUMONIA"):
            (kaggle / split / cls).mkdir(parents=True)
            for i in reversed(range(count)):  # written out of name order: the pick sorts by name
                (kaggle / split / cls / f"{cls.lower()}-{i}.jpeg").write_bytes(b"x")

    def parsed(*extra: str):
        argv = [
            "--recipe",
            "kaggle-few-films",
            *extra,
            "--workdir",
            str(tmp_path / "work"),
            "--data-root",
            str(data_root),
        ]
        return bench_quality.quality_bench().parse(bench_quality.QUICK_DEFAULTS, argv)

    (command,), _ = bench_quality.prepares_and_copy_checks(parsed("--train-films", "2"))
    source = Path(command[command.index("--source") + 1].partition("=")[2]) / "chest_xray"
    assert {cls: sorted(p.name for p in (source / "train" / cls).iterdir()) for cls in ("NORMAL", "PNEUMONIA")} == {
        "NORMAL": ["normal-0.jpeg", "normal-1.jpeg"],
        "PNEUMONIA": ["pneumonia-0.jpeg", "pneumonia-1.jpeg"],
    }
    assert all(len(list((source / "test" / cls).iterdir())) == 3 for cls in ("NORMAL", "PNEUMONIA"))
    (default,), _ = bench_quality.prepares_and_copy_checks(parsed())
    data_dir = lambda c: Path(c[c.index("--data-dir") + 1]).name  # noqa: E731
    assert (data_dir(command), data_dir(default)) == ("kaggle-few-films-224-train2", "kaggle-few-films-224")
    with pytest.raises(SystemExit, match="--subsample: recipe kaggle-few-films takes its own train films"):
        bench_quality.prepares_and_copy_checks(parsed("--subsample", "chest-xray-pneumonia=3"))
    with pytest.raises(SystemExit, match="--train-films"):
        bench_quality.recipe_of(
            bench_quality.quality_bench().parse(
                bench_quality.QUICK_DEFAULTS, ["--recipe", "kaggle-pneumonia", "--train-films", "2"]
            )
        )
