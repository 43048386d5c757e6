"""bench_quality's PREPARED_VIA claim holds: the benchmark's training side takes from those modules only what the
revalidation digests cover.

scripts/bench_quality.py declares PREPARED_VIA, the measured modules that reach
its figures only through what scripts/revalidate_prepared.py digests at two
commits: the data folder `covidxray prepare` writes and the outcome of
`evaluate --external`'s copy check. A report stays fresh across a change of
them once the digests are equal, so nothing else the benchmark runs (train,
evaluate, the script itself after its prepares, and whatever they import) may
take anything from them but the names ALLOWED below. The imports are read with
ast from the ROOTS, followed through every covidxray module they reach except
the PREPARED_VIA modules themselves (what those import runs only through the
allowed names, or in prepare).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import stale_benchmarks  # noqa: E402

BENCH = Path("scripts/bench_quality.py")
MODULE = "<the module>"  # the name taken by `import covidxray.x` or `from covidxray import x`
# What the benchmark runs besides its prepares: files read whole, and of two files only their module level and some
# functions (with the module-level functions and classes those name, and so on): cli.py's commands the benchmark
# types, `covidxray train` and `covidxray evaluate`, and what bench_quality.py takes from _bench.py (shared with the
# other benchmarks, whose helpers prepare phantom data).
ROOTS = (
    "scripts/bench_quality.py",
    "covidxray/train/*.py",
    "covidxray/export/source_profile.py",
    "covidxray/export/class_maps.py",
    "covidxray/manifest.py",
    "covidxray/reports.py",
    "covidxray/config.py",
)
PARTLY = {"covidxray/cli.py": ("train", "evaluate"), "scripts/_bench.py": "the names bench_quality.py takes"}
# (module, name taken) -> (the importer, "file" or "file:function", or None for anywhere; why the digests cover it)
ALLOWED = {
    ("covidxray.edge.preprocess", "PREPROCESSING_VERSION"): (
        None,
        "(a) prepare records the same constant in manifest.json (`preprocessing`), which the digests cover",
    ),
    ("covidxray.data.dedup", MODULE): (
        "covidxray/train/external.py",
        "(b) the copy check, whose outcome revalidate_prepared.py digests per leave-one-out fold",
    ),
    ("covidxray.data.image_cache", "ImageCache"): ("covidxray/train/external.py", "(b) the copy check"),
    ("covidxray.data.image_cache", "cache_path"): ("covidxray/train/external.py", "(b) the copy check"),
    ("covidxray.sources.download", "download"): (
        "covidxray/train/weights.py:download_weights",
        "only `covidxray weights download`, which the benchmark does not run",
    ),
}


@dataclass(frozen=True)
class Use:
    """One name a file takes from a covidxray module at run time."""

    importer: str  # the file, relative to the repository
    scope: str  # the enclosing function or class ("" at module level), dotted when nested
    module: str
    name: str  # MODULE for the module itself

    def where(self) -> str:
        return f"{self.importer}:{self.scope}" if self.scope else self.importer


def module_file(root: Path, module: str) -> Path | None:
    path = root / Path(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, scope: str = ""):
    """(import statement, scope) of every import that can run: `if TYPE_CHECKING:` bodies left out."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, scope
    elif isinstance(node, ast.If) and _type_checking(node.test):
        for statement in node.orelse:
            yield from _imports(statement, scope)
    else:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        for child in ast.iter_child_nodes(node):
            yield from _imports(child, scope)


def named_from(path: Path, module: str) -> tuple[str, ...]:
    """The attributes the file at `path` reads from `module` (`_bench.run` -> run)."""
    return tuple(
        sorted(
            {
                node.attr
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == module
            }
        )
    )


def called(path: Path, names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` and the module-level functions and classes of the file at `path` they name, transitively."""
    definitions = {
        node.name: node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    seen, todo = set(), [name for name in names if name in definitions]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [n.id for n in ast.walk(definitions[name]) if isinstance(n, ast.Name) and n.id in definitions]
    return tuple(sorted(seen))


def uses(root: Path, path: Path, functions: tuple[str, ...] | None = None) -> list[Use]:
    """Every covidxray name the file at `path` takes; with `functions`, only at module level and in those."""
    relative = path.relative_to(root)
    package = ".".join(relative.parent.parts) if relative.parts[0] == "covidxray" else ""
    found = []
    for node, scope in _imports(ast.parse(path.read_text(), str(path))):
        if functions is not None and scope and scope.split(".")[0] not in functions:
            continue
        if isinstance(node, ast.Import):
            taken = [(alias.name, MODULE) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            taken = [
                (f"{base}.{alias.name}", MODULE) if module_file(root, f"{base}.{alias.name}") else (base, alias.name)
                for alias in node.names
            ]
        found += [
            Use(str(relative), scope, module, name) for module, name in taken if module.split(".")[0] == "covidxray"
        ]
    return found


def prepared_via_uses(root: Path, prepared_via: tuple[str, ...]) -> tuple[list[Use], dict[str, str]]:
    """Every use of a PREPARED_VIA module by the ROOTS and the covidxray modules they reach, and for each file
    reached the file that first imported it."""

    def within(module: str) -> bool:
        path = module_file(root, module)
        return path is not None and stale_benchmarks.within(str(path.relative_to(root)), prepared_via)

    todo: list[tuple[Path, tuple[str, ...] | None]] = [
        (path, None) for pattern in ROOTS for path in sorted(root.glob(pattern))
    ]
    for name, functions in PARTLY.items():
        if (root / name).is_file():
            if not isinstance(functions, tuple):  # _bench.py: what bench_quality.py takes from it
                functions = named_from(root / BENCH, Path(name).stem)
            todo.append((root / name, called(root / name, functions)))
    reached = {str(path.relative_to(root)): "" for path, _ in todo}
    found = []
    while todo:
        path, functions = todo.pop()
        for use in uses(root, path, functions):
            if within(use.module):
                found.append(use)
                continue
            parts = use.module.split(".")
            for module in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):  # packages' __init__ run first
                file = module_file(root, module)
                if file is not None and not within(module) and str(file.relative_to(root)) not in reached:
                    reached[str(file.relative_to(root))] = use.importer
                    todo.append((file, None))
    return found, reached


def chain(reached: dict[str, str], file: str) -> str:
    links = [file]
    while reached.get(links[-1]):
        links.append(reached[links[-1]])
    return " <- ".join(links)


def unallowed(found: list[Use]) -> list[Use]:
    def allowed(use: Use) -> bool:
        entry = ALLOWED.get((use.module, use.name))
        return entry is not None and entry[0] in (None, use.importer, use.where())

    return [use for use in found if not allowed(use)]


def test_the_training_side_takes_from_prepared_via_only_what_the_digests_cover():
    prepared_via = stale_benchmarks.declared_prepared_via(REPO / BENCH)
    found, reached = prepared_via_uses(REPO, prepared_via)
    assert "covidxray/train/external.py" in reached and "covidxray/train/trainer.py" in reached
    broken = [
        f"{use.where()} takes {use.name if use.name != MODULE else 'the whole module'} from {use.module} "
        f"(reached: {chain(reached, use.importer)})"
        for use in unallowed(found)
    ]
    assert not broken, (
        f"PREPARED_VIA's claim in {BENCH} would break: these modules reach the figures other than through the "
        "prepared data and the copy check that scripts/revalidate_prepared.py digests, so a report would be "
        "revalidated across a change it did not check. Take the name from elsewhere, or drop the module from "
        f"PREPARED_VIA, or (when a digest does cover the use) add it to ALLOWED in {Path(__file__).name} with why:\n"
        + "\n".join(broken)
    )
    used = {(use.module, use.name) for use in found}
    unused = sorted(set(ALLOWED) - used)
    assert not unused, f"ALLOWED lists uses nothing makes any more, remove them: {unused}"


def test_a_new_use_of_a_prepared_via_module_is_found(tmp_path):
    """The check on a small tree: a train module that calls prepare's dedup, through a helper module."""
    files = {
        "covidxray/__init__.py": "",
        "covidxray/data/__init__.py": "",
        "covidxray/data/dedup.py": "def matches(): ...\n",
        "covidxray/data/prepare.py": "from covidxray.data.dedup import matches\n",
        "covidxray/edge/__init__.py": "",
        "covidxray/edge/preprocess.py": "PREPROCESSING_VERSION = 1\nresize = None\n",
        "covidxray/manifest.py": "from .helper import check\n",
        "covidxray/helper.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from covidxray.data.prepare import x\n"
            "def check():\n    from covidxray.data import dedup\n    return dedup.matches\n"
        ),
        "covidxray/train/trainer.py": (
            "import covidxray.manifest\nfrom covidxray.edge.preprocess import PREPROCESSING_VERSION, resize\n"
        ),
        "covidxray/cli.py": "def train():\n    import covidxray.train.trainer\ndef export():\n    import covidxray.data.prepare\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found, reached = prepared_via_uses(
        tmp_path, ("covidxray/data/dedup.py", "covidxray/data/prepare.py", "covidxray/edge/preprocess.py")
    )
    assert sorted((use.where(), use.module, use.name) for use in unallowed(found)) == [
        ("covidxray/helper.py:check", "covidxray.data.dedup", MODULE),
        ("covidxray/train/trainer.py", "covidxray.edge.preprocess", "resize"),
    ]
    assert chain(reached, "covidxray/helper.py") == "covidxray/helper.py <- covidxray/manifest.py"
