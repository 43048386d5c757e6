"""Show that a change left the prepared data of quality reports identical: revalidation by prepared data.

A bench_quality report depends on `covidxray prepare` (MEASURES names its
code), but part of that code reaches the figures only through the data folder
prepare writes, and for leave-one-out recipes through `evaluate --external`'s
copy check on those folders (PREPARED_VIA in scripts/bench_quality.py). When
only such paths changed from commit --from to commit --to, this script runs
every prepare the report's recorded command runs (bench_quality.prepares_and_copy_checks)
at both commits, each in a detached git worktree of its commit (.venv linked
in), into an empty data folder (so with an empty decode cache: it lives in
<data-dir>/cache) and with an empty HOME and XDG cache, and compares digests of
what each wrote: every file of the data folder, manifest.json without the
fields that differ between two prepares at one commit, the decode cache by its
rows. For every `evaluate --external` the command runs (a leave-one-out fold:
bench_quality.prepares_and_copy_checks pairs its training and held-out
folders) it also runs, at each commit in its worktree, that commit's copy
check (covidxray.train.external.find_copies with the data config `covidxray
evaluate` builds) on copies of the two folders that commit prepared (the
check opens their decode caches read-write and stores what it decodes: the
prepared folders stay as prepare wrote them), and compares the digest of its
outcome: every copy found and every image it could not check, each field as a
string, sorted. When every digest is equal, a record goes into
docs/bench/revalidated.toml and scripts/stale_benchmarks.py counts the report
fresh across that change; otherwise nothing is written and the first
difference is named.

Each (commit, prepare) output, each (commit, copy check) outcome and their
digests stay in --workdir, so a later run for another --to reuses the --from
side. --from equal to --to prepares and checks twice at that commit (a
determinism check) and records nothing.

    python scripts/revalidate_prepared.py --from eba4b92 --to abc1234 --workdir /work/scratch/reval
    python scripts/revalidate_prepared.py --prepare-only eba4b92 --workdir /work/scratch/reval   # the --from side ahead
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import bench_quality
import stale_benchmarks

REPO = Path(__file__).resolve().parents[1]
QUALITY = REPO / "scripts" / "bench_quality.py"
DATA_DIR = "<data-dir>"  # the --data-dir of a recorded prepare command: each commit writes its own folder
# manifest.json keys that differ between two prepares of the same data at the same commit (found by running the
# determinism check): prepare's wall time, and the checksum over the manifest, which includes it.
VOLATILE_MANIFEST_KEYS = ("seconds", "checksum")
SQLITE_SIDE_FILES = ("-wal", "-shm")  # SQLite's journal beside a database: its content is in the database's rows
TRAINING_DIR, HELD_OUT_DIR = "<training-dir>", "<held-out-dir>"  # the folders a copy check read, in its outcome
# A fold's copy check, run by each commit's python in its worktree: argv = training folder, held-out folder, outcome
# file, then the --set overrides of bench_quality's `covidxray evaluate --external`. The data config is the one that
# command builds (cli.resolve: defaults, the --set overrides, --data-dir); the outcome is every Copy and every
# unchecked Record with each field as a string (a Record's fields nested), each list sorted.
COPY_CHECK = """
import dataclasses, json, sys
from covidxray.cli import resolve
from covidxray.manifest import open_prepared
from covidxray.train.external import find_copies

training, held_out, out, *sets = sys.argv[1:]
config = resolve(None, sets, data__data_dir=training)
copies, unchecked = find_copies(open_prepared(training), open_prepared(held_out), config.data, log=print)

def text(value):
    if dataclasses.is_dataclass(value):
        return {field.name: text(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return str(value)

def canonical(items):
    return sorted((text(item) for item in items), key=lambda item: json.dumps(item, sort_keys=True))

with open(out, "w") as handle:
    json.dump({"copies": canonical(copies), "unchecked": canonical(unchecked)}, handle, sort_keys=True)
"""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One prepare's output at one commit: its digest per file of the data folder, and its normalised manifest."""

    command: str  # with DATA_DIR for its --data-dir
    files: dict[str, str]  # path in the data folder -> sha256 of its (normalised) content
    manifest: dict

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Checked:
    """One fold's `evaluate --external` copy check at one commit: what it found on the folders of two prepares."""

    prepares: list[str]  # the training and the held-out prepare, as shown
    overrides: list[str]  # the evaluate's --set overrides
    outcome: dict  # COPY_CHECK's {"copies": [...], "unchecked": [...]}, the folders as TRAINING_DIR, HELD_OUT_DIR

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.outcome, sort_keys=True).encode()).hexdigest()

    @property
    def name(self) -> str:
        return " + ".join(self.prepares)


# --- the prepares of a report --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a report's recorded bench_quality command runs that this script replays."""

    prepares: list[list[str]]
    copy_checks: list[tuple[list[str], list[str]]]  # per `evaluate --external`: its training and held-out prepare


def recorded_run(report: dict, inputs: Path, data_root: Path) -> Recorded:
    """The prepare commands and copy checks of the report's recorded bench_quality command, its --workdir (where
    subsampled copies are made) replaced by `inputs` and its --data-root by `data_root` (this machine's places)."""
    words = shlex.split(report["command"])
    script = next(i for i, word in enumerate(words) if word.endswith("bench_quality.py"))
    argv = [*words[script + 1 :], "--workdir", str(inputs), "--data-root", str(data_root)]
    args = bench_quality.quality_bench().parse(bench_quality.QUICK_DEFAULTS, argv)
    commands, folders = bench_quality.prepares_and_copy_checks(args)
    by_folder = {Path(command[command.index("--data-dir") + 1]): command for command in commands}
    return Recorded(commands, [(by_folder[training], by_folder[held_out]) for training, held_out in folders])


def evaluate_overrides() -> list[str]:
    """The --set overrides of a fold's `covidxray evaluate --external` (bench_quality.external_evaluate)."""
    words = bench_quality.external_evaluate(Path(TRAINING_DIR), Path("<run-dir>"), Path(HELD_OUT_DIR))
    if "--config" in words:
        sys.exit("bench_quality's evaluate --external takes a --config: its copy check cannot be replayed here")
    return [words[i + 1] for i, word in enumerate(words) if word == "--set"]


def with_data_dir(command: list[str], data_dir: str) -> list[str]:
    at = command.index("--data-dir") + 1
    return [*command[:at], data_dir, *command[at + 1 :]]


def shown(command: list[str]) -> str:
    """The command as recorded: `covidxray prepare ... --data-dir <data-dir>` (the executable is each commit's)."""
    return shlex.join(["covidxray", *with_data_dir(command, DATA_DIR)[1:]])


# --- worktrees and prepares ----------------------------------------------------------------------------


def resolve(commit: str) -> str:
    sha = stale_benchmarks.git(REPO, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").stdout.strip()
    if not sha:
        sys.exit(f"{commit!r} is not a commit of {REPO}")
    return sha


def worktree(sha: str, workdir: Path) -> Path:
    """A detached, clean worktree of `sha` under `workdir`, with this checkout's .venv linked in; made once."""
    tree = workdir / "trees" / sha
    with locked(tree):
        if not tree.is_dir():
            checked(["git", "worktree", "add", "--detach", str(tree), sha], REPO)
            (tree / ".venv").symlink_to((REPO / ".venv").resolve())
    head = stale_benchmarks.git(tree, "rev-parse", "HEAD").stdout.strip()
    dirty = stale_benchmarks.git(tree, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if head != sha or dirty:
        sys.exit(f"{tree} is not a clean checkout of {sha}: remove it (git worktree remove --force {tree})")
    return tree


@contextlib.contextmanager
def locked(path: Path):
    """Hold `path`.lock: two runs sharing --workdir (the --from side prepared ahead while another revalidates) never
    build the same worktree or data folder at once, nor clear one the other is writing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def checked(command: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, **kwargs)
    if result.returncode:
        sys.exit(f"failed ({result.returncode}): {shlex.join(command)}\n{result.stderr[-4000:]}")
    return result


def clean_environment(tree: Path, home: Path) -> dict[str, str]:
    """The tree's covidxray first on the path (the venv's editable install points elsewhere), and an empty HOME and
    XDG cache, so that no cache outside the data folder is shared between commits or runs."""
    for folder in (home, home / "cache"):
        folder.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(tree), "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache")}


def require_own_code(tree: Path, env: dict[str, str]) -> None:
    """Refuse to prepare unless `import covidxray` in the tree's venv loads the tree's own package."""
    probe = [str(tree / ".venv" / "bin" / "python"), "-c", "import covidxray; print(covidxray.__file__)"]
    # run outside the tree, as the covidxray script runs: only PYTHONPATH can make the tree's package win
    loaded = Path(checked(probe, Path(env["HOME"]), env=env).stdout.strip()).resolve()
    if not loaded.is_relative_to(tree.resolve()):
        sys.exit(f"in {tree}, covidxray is imported from {loaded}, not from the worktree")


def prepared_slot(sha: str, command: list[str], workdir: Path, slot_suffix: str = "") -> Path:
    """Where `command` at `sha` writes its data folder (`slot`/data), log and digest."""
    key = hashlib.sha256(shown(command).encode()).hexdigest()[:16]
    return workdir / "prepared" / sha / (key + slot_suffix)


def prepared(sha: str, command: list[str], workdir: Path, slot_suffix: str = "") -> Prepared:
    """`command` run at `sha` into a fresh data folder and digested; the output of an earlier run when complete."""
    slot = prepared_slot(sha, command, workdir, slot_suffix)
    with locked(slot):
        return _prepared_in(slot, sha, command, workdir)


def finished(result: Path) -> dict | None:
    """What an earlier run wrote to `result` when it finished; else None, with the slot (`result`'s folder) emptied:
    nothing an interrupted run left (a decode cache, shards, copies holding what a check decoded) is reused."""
    if result.is_file():
        return json.loads(result.read_text())
    if result.parent.exists():
        shutil.rmtree(result.parent)
    return None


def run_logged(command: list[str], tree: Path, env: dict[str, str], log: Path, what: str, sha: str) -> None:
    """`command` run in `tree` with its output in `log`; stop, naming `what` and the log, when it fails."""
    with open(log, "w") as handle:
        code = subprocess.run(command, cwd=tree, env=env, stdout=handle, stderr=handle).returncode
    if code:
        sys.exit(f"{what} failed ({code}) at {sha[:7]}, see {log}")


def tree_to_run(sha: str, workdir: Path, slot: Path) -> tuple[Path, dict[str, str]]:
    """The worktree of `sha` and the environment to run its code in, checked to load that tree's own package."""
    tree = worktree(sha, workdir)
    env = clean_environment(tree, slot / "home")
    require_own_code(tree, env)
    return tree, env


def _prepared_in(slot: Path, sha: str, command: list[str], workdir: Path) -> Prepared:
    result = slot / "digest.json"
    earlier = finished(result)
    if earlier:
        return Prepared(**earlier)
    tree, env = tree_to_run(sha, workdir, slot)
    data_dir = slot / "data"
    covidxray = str(tree / ".venv" / "bin" / "covidxray")
    print(f"{sha[:7]}: {shown(command)}", flush=True)
    run_logged([covidxray, *with_data_dir(command, str(data_dir))[1:]], tree, env, slot / "prepare.log", "prepare", sha)
    outcome = digest_data_dir(data_dir, shown(command))
    result.write_text(json.dumps(dataclasses.asdict(outcome), indent=1))
    return outcome


def copy_checked(
    sha: str, prepares: tuple[list[str], list[str]], overrides: list[str], workdir: Path, slot_suffix: str = ""
) -> Checked:
    """The copy check of `sha` on copies of the folders its two `prepares` (training, held-out) wrote at `sha`, its
    outcome canonical; the outcome of an earlier run when complete."""
    for command in prepares:
        prepared(sha, command, workdir, slot_suffix)  # made (or found complete) first
    shown_prepares = [shown(command) for command in prepares]
    key = hashlib.sha256(json.dumps([shown_prepares, overrides]).encode()).hexdigest()[:16]
    slot = workdir / "copy-checks" / sha / (key + slot_suffix)
    with locked(slot):
        return _checked_in(slot, sha, prepares, overrides, workdir, slot_suffix)


def _checked_in(
    slot: Path, sha: str, prepares: tuple[list[str], list[str]], overrides: list[str], workdir: Path, slot_suffix: str
) -> Checked:
    result = slot / "outcome.json"
    earlier = finished(result)
    if earlier:
        return Checked(**earlier)
    tree, env = tree_to_run(sha, workdir, slot)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # The check opens each folder's decode cache read-write (SQLite in WAL mode, storing whatever it decodes): it
    # runs on copies, and the prepared folders, which other copy checks and digests read, are never opened by it.
    copies = {TRAINING_DIR: slot / "training", HELD_OUT_DIR: slot / "held-out"}
    originals = {}
    for placeholder, command in zip(copies, prepares):
        source = prepared_slot(sha, command, workdir, slot_suffix)
        with locked(source):  # complete (its digest is written): only read, never cleared while held
            originals[source / "data"] = listing(source / "data")
            shutil.copytree(source / "data", copies[placeholder], symlinks=True)
    raw = slot / "outcome.raw.json"
    names = [shown(command) for command in prepares]
    print(f"{sha[:7]}: copy check {' + '.join(names)}", flush=True)
    python = str(tree / ".venv" / "bin" / "python")
    check = [python, "-c", COPY_CHECK, *(str(folder) for folder in copies.values()), str(raw), *overrides]
    run_logged(check, tree, env, slot / "check.log", "copy check", sha)
    for folder, before in originals.items():
        if listing(folder) != before:
            sys.exit(f"{folder} changed during the copy check at {sha[:7]}: its digest no longer stands; remove it")
    text = raw.read_text()
    for placeholder, folder in copies.items():
        text = text.replace(json.dumps(str(folder))[1:-1], placeholder)
    outcome = Checked(names, overrides, json.loads(text))
    result.write_text(json.dumps(dataclasses.asdict(outcome), indent=1))
    for folder in copies.values():
        shutil.rmtree(folder)
    return outcome


def listing(folder: Path) -> list[tuple[str, int, int]]:
    """Every file under `folder` with its size and modification time: what any write would change."""
    return [
        (str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    ]


# --- digests -------------------------------------------------------------------------------------------


def digest_data_dir(data_dir: Path, command: str) -> Prepared:
    files = {
        str(path.relative_to(data_dir)): file_digest(path, data_dir)
        for path in sorted(data_dir.rglob("*"))
        if path.is_file() and not path.name.endswith(SQLITE_SIDE_FILES)
    }
    return Prepared(command, files, normalised_manifest(data_dir))


def file_digest(path: Path, data_dir: Path) -> str:
    if path.name == "manifest.json":
        content = json.dumps(normalised_manifest(data_dir), sort_keys=True).encode()
    elif path.suffix == ".sqlite":
        content = database_rows(path)
    else:
        content = path.read_bytes()
    return hashlib.sha256(content).hexdigest()


def normalised_manifest(data_dir: Path) -> dict:
    """manifest.json without its volatile keys, the data folder's own path written as DATA_DIR."""
    text = (data_dir / "manifest.json").read_text().replace(json.dumps(str(data_dir))[1:-1], DATA_DIR)
    manifest = json.loads(text)
    for key in VOLATILE_MANIFEST_KEYS:
        manifest.pop(key, None)
    return manifest


def database_rows(path: Path) -> bytes:
    """Every table's rows, sorted: what a reader gets (the file's bytes also hold page layout and free space)."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return repr([(table, sorted(db.execute(f'SELECT * FROM "{table}"'))) for table in tables]).encode()


def first_difference(before: Prepared, after: Prepared) -> str:
    """Where two outputs of one prepare first differ: a file present on one side only or with other content, and
    for manifest.json its first differing key."""
    for name in sorted(set(before.files) | set(after.files)):
        if before.files.get(name) != after.files.get(name):
            if name not in before.files or name not in after.files:
                return f"{name} only at {'--to' if name in after.files else '--from'}"
            if name == "manifest.json":
                return f"manifest.json key {differing_key(before.manifest, after.manifest)}"
            return f"{name} differs"
    return "nothing"


def first_different_copy(before: Checked, after: Checked) -> str:
    """Where two outcomes of one copy check first differ: how many copies or unchecked images, or the first entry."""
    for part in ("copies", "unchecked"):
        one, other = before.outcome[part], after.outcome[part]
        for index, (mine, theirs) in enumerate(zip(one, other)):
            if mine != theirs:
                return f"{part}[{index}]: {json.dumps(mine)[:300]} -> {json.dumps(theirs)[:300]}"
        if len(one) != len(other):
            return f"{part}: {len(one)} -> {len(other)}"
    return "nothing"


def differing_key(before, after, where: str = "") -> str:
    """The first key (`splits.train.records`, `shards[2].sha256`) whose values differ, with both values."""
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            if before.get(key) != after.get(key):
                return differing_key(before.get(key), after.get(key), f"{where}.{key}" if where else key)
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        for index, (one, other) in enumerate(zip(before, after)):
            if one != other:
                return differing_key(one, other, f"{where}[{index}]")
    return f"{where}: {json.dumps(before)[:200]} -> {json.dumps(after)[:200]}"


# --- reports -------------------------------------------------------------------------------------------


def quality_report(name: str) -> dict:
    report = json.loads((REPO / stale_benchmarks.REPORTS / name).read_text())
    if report["benchmark"] != "quality":
        sys.exit(f"{name} is a bench_{report['benchmark']} report: only bench_quality declares its prepares")
    return report


def quality_reports_fresh_at(commit: str) -> list[str]:
    """Every bench_quality report that describes the code at `commit` (the ones worth carrying from it): after a
    change, the working tree's reports are stale until revalidated, so freshness is judged at the --from side."""
    paths = sorted((REPO / stale_benchmarks.REPORTS).glob("*.json"))
    names = [path.name for path in paths if json.loads(path.read_text())["benchmark"] == "quality"]
    return [name for name in names if is_fresh_at(quality_report(name), name, commit)]


def is_fresh_at(report: dict, name: str, at: str) -> bool:
    """The report describes the code at commit `at`: measured there, or carried there by earlier records."""
    records = stale_benchmarks.revalidations(REPO).get(name, [])
    changed, chain = stale_benchmarks.freshness(REPO, report, QUALITY, records, at)
    return changed == () or bool(chain)


def refusal(report: dict, name: str, old: str, new: str) -> str | None:
    """Why prepared data cannot vouch for `report` across `old`..`new`, or None: the report must be fresh at `old`
    (directly or through earlier records), and every measured path that changed must be in PREPARED_VIA."""
    if not is_fresh_at(report, name, old):
        commit = report["environment"].get("git_commit", "")
        return f"it is not fresh at {old[:7]} (measured at {commit or 'no commit'})"
    prepared_via = stale_benchmarks.declared_prepared_via(QUALITY)
    outside = [p for p in changed_paths(old, new) if not stale_benchmarks.within(p, prepared_via)]
    if outside:
        return f"{', '.join(outside)} changed and reach the figures other than through the prepared data"
    return None


def changed_paths(old: str, new: str) -> tuple[str, ...]:
    return stale_benchmarks.changed_between(REPO, old, new, stale_benchmarks.declared_measures(QUALITY)) or ()


def revalidate(name: str, old: str, new: str, args: argparse.Namespace) -> bool:
    """Prepare the report's data at both commits; record the revalidation when every digest is equal."""
    report = quality_report(name)
    why_not = refusal(report, name, old, new)
    if why_not:
        print(f"{name}: not revalidated, {why_not}")
        return False
    run = recorded_run(report, args.workdir / "inputs", args.data_root)
    again = "-again" if old == new else ""
    pairs = [
        (prepared(old, command, args.workdir), prepared(new, command, args.workdir, again)) for command in run.prepares
    ]
    differing = [(before, after) for before, after in pairs if before.digest != after.digest]
    for before, after in differing:
        print(f"{name}: DIFFERS: {before.command}: first at {first_difference(before, after)}")
    if differing:
        return False
    overrides = evaluate_overrides() if run.copy_checks else []
    checks = [
        (
            copy_checked(old, prepares, overrides, args.workdir),
            copy_checked(new, prepares, overrides, args.workdir, again),
        )
        for prepares in run.copy_checks
    ]
    different = [(before, after) for before, after in checks if before.digest != after.digest]
    for before, after in different:
        print(f"{name}: DIFFERS: copy check {before.name}: first at {first_different_copy(before, after)}")
    if different:
        return False
    print(
        f"{name}: every prepared data folder and copy check identical at {old[:7]} and {new[:7]} "
        f"({len(pairs)} prepare(s), {len(checks)} copy check(s))"
    )
    if old != new:  # the same commit twice only shows that prepare and the check are deterministic
        record(name, report, old, new, [before for before, _ in pairs], [before for before, _ in checks])
    return True


def record(name: str, report: dict, old: str, new: str, outputs: list[Prepared], checks: list[Checked]) -> None:
    commands = [output.command for output in outputs]
    entry = {
        "from": old,
        "to": new,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": report["command"],
        "changed": list(changed_paths(old, new)),
        "prepares": commands,
        "digests": [output.digest for output in outputs],
        # per `evaluate --external`: the prepares of its training and held-out folders, and its outcome's digest
        "copy_checks": [" + ".join(f"prepares[{commands.index(p)}]" for p in check.prepares) for check in checks],
        "copy_check_digests": [check.digest for check in checks],
    }
    with open(REPO / stale_benchmarks.REVALIDATED, "a") as handle:
        handle.write(stale_benchmarks.revalidation_toml(name, entry))
    print(f"{name}: recorded in {stale_benchmarks.REVALIDATED}")


def prepare_only(name: str, sha: str, args: argparse.Namespace) -> None:
    run = recorded_run(quality_report(name), args.workdir / "inputs", args.data_root)
    for command in run.prepares:
        print(f"{name}: {prepared(sha, command, args.workdir).digest[:16]} {shown(command)}", flush=True)
    overrides = evaluate_overrides() if run.copy_checks else []
    for prepares in run.copy_checks:
        checked = copy_checked(sha, prepares, overrides, args.workdir)
        print(f"{name}: {checked.digest[:16]} copy check {checked.name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="old", help="the commit the reports are fresh at")
    parser.add_argument("--to", dest="new", help="the commit to carry them to")
    parser.add_argument(
        "--prepare-only", metavar="COMMIT", help="only prepare, copy-check and digest at COMMIT (the --from side)"
    )
    parser.add_argument(
        "--reports", nargs="+", help="report files in docs/bench (default: every quality report fresh at --from)"
    )
    parser.add_argument("--workdir", type=Path, required=True, help="worktrees, prepared data and digests (reused)")
    parser.add_argument("--data-root", type=Path, default=REPO.parent / "shared" / "data", help="the source folders")
    args = parser.parse_args()
    if not args.prepare_only and not (args.old and args.new):
        parser.error("give --from and --to, or --prepare-only")
    args.workdir = args.workdir.resolve()
    if args.prepare_only:
        sha = resolve(args.prepare_only)
        for name in args.reports or quality_reports_fresh_at(sha):
            prepare_only(name, sha, args)
        return
    old, new = resolve(args.old), resolve(args.new)
    reports = args.reports or quality_reports_fresh_at(old)
    failed = [name for name in reports if not revalidate(name, old, new, args)]
    sys.exit(f"not revalidated: {', '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
