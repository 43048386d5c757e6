"""Which docs/bench reports no longer describe the code: a measured module changed after the commit a report records.

Every scripts/bench_NAME.py declares what it measures in a module-level
`MEASURES = ("covidxray/...", ...)` (files or folders, relative to the
repository), read here with `ast`, so nothing is imported. Every report in
docs/bench records `benchmark` (NAME), `command` and `environment.git_commit`.
A report is stale when the commit is missing or unknown to this repository, or
when a declared path differs between that commit and the working tree. That is
a tree comparison (`git diff`), so a report written on a branch that landed
later is judged by what it measured, not by the history in between; a Python
file whose syntax tree is unchanged (reformatted, other comments) counts as
unchanged. docs/bench/known_stale.toml lists the reports known to be stale,
each with why and what re-running it needs; tests/test_bench_fresh.py fails on
any other stale report and on a listed report that is fresh again.

    python scripts/stale_benchmarks.py   # every stale report, what changed, the command to re-run it; exit 1 on a new one
"""

from __future__ import annotations

import ast
import functools
import json
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORTS = Path("docs/bench")
KNOWN_STALE = REPORTS / "known_stale.toml"


@dataclass(frozen=True)
class Staleness:
    report: str  # file name in docs/bench
    benchmark: str
    commit: str
    changed: tuple[str, ...]  # declared paths that differ from the commit; empty when the commit is unknown
    rerun: str  # the recorded command, writing to the report's place in docs/bench

    def line(self) -> str:
        why = f"changed since {self.commit}: {summarize(self.changed)}" if self.changed else self._unknown()
        return f"{self.report} (bench_{self.benchmark}) is stale, {why}; re-run: {self.rerun}"

    def _unknown(self) -> str:
        return f"its commit {self.commit!r} is unknown here" if self.commit else "it records no git commit"


def summarize(paths: tuple[str, ...]) -> str:
    """`a/x.py, a/y.py, a/z.py, b.py` -> `a/ (3 files), b.py`: a folder where more than two of its files changed."""
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        by_folder.setdefault(str(Path(path).parent), []).append(path)
    parts = [
        f"{folder}/ ({len(files)} files)" if len(files) > 2 else ", ".join(files) for folder, files in by_folder.items()
    ]
    return ", ".join(parts)


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def is_checkout(repo: Path) -> bool:
    """True when `repo` is the top of a git work tree (not, e.g., a source tarball unpacked inside another one)."""
    try:
        top = git(repo, "rev-parse", "--show-toplevel")
    except FileNotFoundError:  # no git installed
        return False
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == repo.resolve()


def is_shallow(repo: Path) -> bool:
    return git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"


def declared_measures(script: Path) -> tuple[str, ...]:
    """The script's module-level MEASURES tuple of repository paths, read without importing the script."""
    for node in ast.parse(script.read_text(), str(script)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MEASURES" for t in node.targets):
            measures = ast.literal_eval(node.value)
            if measures and isinstance(measures, tuple) and all(isinstance(m, str) for m in measures):
                return measures
    raise ValueError(f'{script} declares no MEASURES = ("covidxray/...", ...) tuple of the paths it measures')


def changed_since(repo: Path, commit: str, paths: tuple[str, ...]) -> tuple[str, ...] | None:
    """Declared paths (or the files under a declared folder) that differ between `commit` and the working tree;
    None when the commit is missing or unknown to the repository."""
    if not commit or git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").returncode:
        return None
    diff = git(repo, "diff", "--name-only", "--no-renames", commit, "--", *paths)
    if diff.returncode:
        raise RuntimeError(f"git diff {commit} failed in {repo}: {diff.stderr.strip()}")
    changed = sorted(set(diff.stdout.split()))
    python = [path for path in changed if path.endswith(".py") and (repo / path).is_file()]
    before = dict(zip(python, _blobs(repo, [f"{commit}:{path}" for path in python])))
    return tuple(path for path in changed if not _same_code(before.get(path), repo / path))


def _same_code(before: bytes | None, now: Path) -> bool:
    """Python source whose syntax tree is unchanged: only its formatting or comments differ (a `ruff format` commit)."""
    tree = _syntax_tree(before) if before is not None else None
    return tree is not None and tree == _syntax_tree(now.read_bytes())


def _blobs(repo: Path, specs: list[str]) -> list[bytes | None]:
    """The content of each `commit:path` (None where it does not exist), from one `git cat-file --batch`."""
    if not specs:
        return []
    out = subprocess.run(
        ["git", "cat-file", "--batch"], cwd=repo, input="\n".join(specs).encode() + b"\n", capture_output=True
    ).stdout
    blobs, at = [], 0
    for _ in specs:
        end = out.index(b"\n", at)
        header = out[at:end].split()
        if header[-1] == b"missing":
            blobs.append(None)
            at = end + 1
        else:
            size = int(header[2])
            blobs.append(out[end + 1 : end + 1 + size])
            at = end + 1 + size + 1  # the content ends with a newline of the batch format's own
    return blobs


@functools.cache
def _syntax_tree(source: bytes) -> str | None:
    """The syntax tree of Python source (no formatting, no comments); None when it does not parse."""
    try:
        return ast.dump(ast.parse(source))
    except SyntaxError:
        return None


def rerun_command(report: dict, report_path: Path) -> str:
    """The recorded command with the script at its place in this repository and --out at the report's place."""
    words = shlex.split(report["command"])
    script = f"scripts/bench_{report['benchmark']}.py"
    words = [script if word.endswith(f"/{script}") else word for word in words]
    if "--out" in words:
        words[words.index("--out") + 1] = str(report_path)
    else:
        words += ["--out", str(report_path)]
    return shlex.join(words)


def stale_reports(repo: Path) -> list[Staleness]:
    """Every report in `repo`/docs/bench whose measured paths changed since its commit, or whose commit is unknown."""
    stale = []
    for path in sorted((repo / REPORTS).glob("*.json")):
        report = json.loads(path.read_text())
        name, commit = report["benchmark"], report["environment"].get("git_commit", "")
        measures = declared_measures(repo / "scripts" / f"bench_{name}.py")
        changed = changed_since(repo, commit, measures)
        if changed is None or changed:
            stale.append(Staleness(path.name, name, commit, changed or (), rerun_command(report, REPORTS / path.name)))
    return stale


def known_stale(repo: Path) -> dict[str, dict]:
    """docs/bench/known_stale.toml: report file name -> {reason, rerun_needs}."""
    path = repo / KNOWN_STALE
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def main() -> None:
    if not is_checkout(REPO):
        sys.exit(f"{REPO} is not a git checkout: staleness cannot be told")
    known = known_stale(REPO)
    stale = stale_reports(REPO)
    for item in stale:
        print(("known: " if item.report in known else "NEW: ") + item.line())
    new = sum(item.report not in known for item in stale)
    print(f"{len(stale)} stale report(s), {new} not in {KNOWN_STALE}")
    sys.exit(1 if new else 0)


if __name__ == "__main__":
    main()
