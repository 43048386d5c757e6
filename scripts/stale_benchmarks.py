"""Which docs/bench reports no longer describe the code: a measured module changed after the commit a report records.

Every scripts/bench_NAME.py declares what it measures in a module-level
`MEASURES = ("covidxray/...", ...)` (files or folders, relative to the
repository), read here with `ast`, so nothing is imported. Every report in
docs/bench records `benchmark` (NAME), `command` and `environment.git_commit`.
A report is stale when the commit is missing or unknown to this repository, or
when a declared path differs between that commit and the working tree. That is
a tree comparison (`git diff`), so a report written on a branch that landed
later is judged by what it measured, not by the history in between; a Python
file whose syntax tree is unchanged (reformatted, other comments), or a YAML
file whose data is, counts as unchanged; in Python a dataclass field another
commit added, or a `setting(...)`'s allowed range, is no change either (so
covidxray/config.py, measured by every benchmark for its defaults, stales a
report when a default changes, not when a feature adds a setting). docs/bench/known_stale.toml lists the reports known to be stale,
each with why and what re-running it needs; tests/test_bench_fresh.py fails on
any other stale report and on a listed report that is fresh again.

A script may also declare `PREPARED_VIA = (...)`: the part of its MEASURES
whose effect on the figures passes only through the data folder `covidxray
prepare` writes (and, for bench_quality, the copy check `evaluate --external`
runs on such folders). docs/bench/revalidated.toml holds records written by
scripts/revalidate_prepared.py, each showing that every prepare a report runs
wrote the same data, and every copy check found the same copies, at commit
`from` as at commit `to`. A report whose measured
paths changed is still fresh through a chain of such records (of its recorded
command): measured paths unchanged from its commit to the first record's
`from`, each record's changes within PREPARED_VIA, unchanged from one record's
`to` to the next one's `from`, and unchanged from the last `to` to the working
tree.

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
REVALIDATED = REPORTS / "revalidated.toml"
WORKING_TREE = None  # as the newer side of a comparison: the files as they are now, committed or not


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


@dataclass(frozen=True)
class Revalidated:
    """A report whose measured paths changed, fresh through revalidation records (prepared data shown identical)."""

    report: str
    benchmark: str
    commit: str
    chain: tuple[dict, ...]  # the revalidation records, oldest first

    def line(self) -> str:
        steps = ", ".join(f"{record['from'][:7]}..{record['to'][:7]}" for record in self.chain)
        return (
            f"{self.report} (bench_{self.benchmark}) measured at {self.commit} is fresh through revalidation: "
            f"prepared data identical across {steps} ({REVALIDATED})"
        )


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
    measures = _declared(script, "MEASURES")
    if not measures:
        raise ValueError(f'{script} declares no MEASURES = ("covidxray/...", ...) tuple of the paths it measures')
    return measures


def declared_prepared_via(script: Path) -> tuple[str, ...]:
    """The script's PREPARED_VIA (empty when it declares none): measured paths whose effect on the figures passes
    only through what scripts/revalidate_prepared.py digests (the data folder `covidxray prepare` writes)."""
    prepared_via = _declared(script, "PREPARED_VIA") or ()
    measures = declared_measures(script)
    outside = [path for path in prepared_via if not within(path, measures)]
    if outside:
        raise ValueError(f"{script}: PREPARED_VIA names {', '.join(outside)}, which MEASURES does not cover")
    return prepared_via


def _declared(script: Path, name: str) -> tuple[str, ...] | None:
    """A module-level `name = ("path", ...)` tuple of strings; None when absent or of another shape."""
    for node in ast.parse(script.read_text(), str(script)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            value = ast.literal_eval(node.value)
            if value and isinstance(value, tuple) and all(isinstance(v, str) for v in value):
                return value
    return None


def within(path: str, folders: tuple[str, ...]) -> bool:
    """`path` is one of `folders` (files or folders) or lies under one."""
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)


def is_commit(repo: Path, commit: str) -> bool:
    return bool(commit) and not git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").returncode


def changed_between(repo: Path, old: str, new: str | None, paths: tuple[str, ...]) -> tuple[str, ...] | None:
    """Declared paths (or the files under a declared folder) that differ between commit `old` and commit `new`
    (WORKING_TREE: the files as they are), Python with the same syntax tree or YAML with the same data unchanged;
    None when a commit is missing or unknown to the repository."""
    if not is_commit(repo, old) or (new is not WORKING_TREE and not is_commit(repo, new)):
        return None
    diff = git(repo, "diff", "--name-only", "--no-renames", old, *([new] if new else []), "--", *paths)
    if diff.returncode:
        raise RuntimeError(f"git diff {old} {new or ''} failed in {repo}: {diff.stderr.strip()}")
    changed = sorted(set(diff.stdout.split()))
    readable = [path for path in changed if Path(path).suffix in _MEANING]
    before = dict(zip(readable, _blobs(repo, [f"{old}:{path}" for path in readable])))
    if new is WORKING_TREE:
        after = {path: (repo / path).read_bytes() if (repo / path).is_file() else None for path in readable}
    else:
        after = dict(zip(readable, _blobs(repo, [f"{new}:{path}" for path in readable])))
    return tuple(path for path in changed if not _same_meaning(path, before.get(path), after.get(path)))


def _same_meaning(path: str, before: bytes | None, after: bytes | None) -> bool:
    """Python source whose syntax tree is unchanged, or YAML whose data is: only formatting or comments differ
    (a `ruff format` commit, a config comment updated with a new measurement). In Python, dataclass fields are
    compared as `_python_reading` says: a field added, or a setting's allowed range changed, is no change."""
    if before is None or after is None:
        return False
    if Path(path).suffix == ".py":
        old, new = _python_reading(before), _python_reading(after)
        if old is None or new is None:
            return False
        (code, fields), (new_code, new_fields) = old, new
        kept_order = [name for name in new_fields if name in fields] == list(fields)  # positional construction
        return code == new_code and kept_order and all(new_fields.get(name) == value for name, value in fields.items())
    reading = _yaml_data(before)
    return reading is not None and reading == _yaml_data(after)


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


# covidxray/strict.py's `setting(default, *, low, high, above, choices, default_factory)`: the keywords that only
# say which values a config may hold
_SETTING_LIMITS = {"low", "high", "above", "choices"}


@functools.cache
def _python_reading(source: bytes) -> tuple[str, dict[str, str]] | None:
    """(the syntax tree of Python source without its dataclass fields, each dataclass field's declaration by
    "Class.field"); no formatting, no comments; None when it does not parse.

    Fields are read apart because of covidxray/config.py, whose defaults decide what every benchmark runs with: a
    changed, removed or moved field changes the file, but a field another commit added does not (only code that reads it
    can change a figure, and that code changed too), nor does a `setting(...)`'s allowed range (a command that ran
    before holds values inside the old range; a narrower one refuses it rather than changing its figures). The
    assumption: no code computes with the list of a dataclass's fields. Here `dataclasses.asdict` and `fields`
    only write records (config.yaml, manifest.json, reports), parse a config's keys, or name a phantom set's
    cache folder; code that iterated over fields to decide what to run would need its class compared whole."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    fields = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_names_dataclass(decorator) for decorator in node.decorator_list):
            kept = []
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    fields[f"{node.name}.{statement.target.id}"] = ast.dump(_without_limits(statement))
                else:
                    kept.append(statement)
            node.body = kept
    return ast.dump(tree), fields


def _names_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return getattr(target, "id", getattr(target, "attr", None)) == "dataclass"


def _without_limits(field: ast.AnnAssign) -> ast.AnnAssign:
    value = field.value
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "setting":
        value.keywords = [keyword for keyword in value.keywords if keyword.arg not in _SETTING_LIMITS]
    return field


@functools.cache
def _yaml_data(source: bytes) -> str | None:
    """The data of a YAML document (no formatting, no comments), as canonical JSON; None when it does not parse."""
    import yaml  # the config loader's own dependency; imported here so listing reports needs nothing else

    try:
        return json.dumps(yaml.safe_load(source), sort_keys=True, default=str)
    except yaml.YAMLError:
        return None


# Files whose meaning can be compared instead of their bytes (`_same_meaning`), by suffix
_MEANING = (".py", ".yaml", ".yml")


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
    """Every report in `repo`/docs/bench whose measured paths changed since its commit, or whose commit is unknown,
    and that no chain of revalidation records vouches for."""
    return assess_reports(repo)[0]


def assess_reports(repo: Path) -> tuple[list[Staleness], list[Revalidated]]:
    """(the stale reports, the reports fresh only through revalidation records), each list sorted by report."""
    stale, revalidated = [], []
    records = revalidations(repo)
    for path in sorted((repo / REPORTS).glob("*.json")):
        report = json.loads(path.read_text())
        name, commit = report["benchmark"], report["environment"].get("git_commit", "")
        changed, chain = freshness(repo, report, repo / "scripts" / f"bench_{name}.py", records.get(path.name, []))
        if changed == ():
            continue
        if chain:
            revalidated.append(Revalidated(path.name, name, commit, chain))
        else:
            stale.append(Staleness(path.name, name, commit, changed or (), rerun_command(report, REPORTS / path.name)))
    return stale, revalidated


def freshness(
    repo: Path, report: dict, script: Path, records: list[dict], target: str | None = WORKING_TREE
) -> tuple[tuple[str, ...] | None, tuple[dict, ...] | None]:
    """(the paths `script` measures that differ between the report's commit and `target`, None when the commit is
    unknown; when any do, the revalidation records, of the report's own recorded command, that carry it there)."""
    commit = report["environment"].get("git_commit", "")
    measures = declared_measures(script)
    changed = changed_between(repo, commit, target, measures)
    if changed == ():
        return changed, None
    own = [record for record in records if record.get("command") == report["command"]]
    return changed, revalidation_chain(repo, commit, measures, declared_prepared_via(script), own, target)


def revalidation_chain(
    repo: Path,
    commit: str,
    measures: tuple[str, ...],
    prepared_via: tuple[str, ...],
    records: list[dict],
    target: str | None = WORKING_TREE,
) -> tuple[dict, ...] | None:
    """Records that carry a report measured at `commit` to `target` (default the working tree), oldest first:
    measured paths unchanged up to each record's `from`, changed only within `prepared_via` from its `from` to its
    `to`, and unchanged from the last `to` to `target`. None when there is no such chain.

    A depth-first search from `commit`; each record is used at most once, so it ends."""

    def unchanged(old: str, new: str | None) -> bool:
        return changed_between(repo, old, new, measures) == ()

    def carried(record: dict) -> bool:
        changed = changed_between(repo, record["from"], record["to"], measures)
        return changed is not None and all(within(path, prepared_via) for path in changed)

    usable = [record for record in records if prepared_via and carried(record)]

    def search(at: str, left: list[dict]) -> tuple[dict, ...] | None:
        for record in left:
            if unchanged(at, record["from"]):
                if unchanged(record["to"], target):
                    return (record,)
                rest = search(record["to"], [other for other in left if other is not record])
                if rest:
                    return (record, *rest)
        return None

    return search(commit, usable) if is_commit(repo, commit) else None


def known_stale(repo: Path) -> dict[str, dict]:
    """docs/bench/known_stale.toml: report file name -> {reason, rerun_needs}."""
    path = repo / KNOWN_STALE
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def revalidations(repo: Path) -> dict[str, list[dict]]:
    """docs/bench/revalidated.toml: report file name -> its revalidation records, in the order written."""
    path = repo / REVALIDATED
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def revalidation_toml(report: str, record: dict) -> str:
    """One record as a TOML array-of-tables entry under the report's name (appended to docs/bench/revalidated.toml).
    Values are strings or lists of strings; JSON's string escapes are TOML's."""
    lines = [f"\n[[{json.dumps(report)}]]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in record.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    if not is_checkout(REPO):
        sys.exit(f"{REPO} is not a git checkout: staleness cannot be told")
    known = known_stale(REPO)
    stale, revalidated = assess_reports(REPO)
    for item in revalidated:
        print("revalidated: " + item.line())
    for item in stale:
        print(("known: " if item.report in known else "NEW: ") + item.line())
    new = sum(item.report not in known for item in stale)
    print(f"{len(stale)} stale report(s), {new} not in {KNOWN_STALE}")
    sys.exit(1 if new else 0)


if __name__ == "__main__":
    main()
