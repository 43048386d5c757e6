"""The tasks that collapse the harmonised label vocabulary to class sets.

Sources map their own findings onto HARMONISED_LABELS (covidxray/records.py:
fine-grained, shared by all sources); a task then decides which of those it
uses and how they group.
A label a task does not use is dropped with a counted reason, never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from covidxray.errors import UserError
from covidxray.registry import Registry

# class -> images: a manifest's split summary, or a Counter of class_of(label) (None for a label of no class)
ClassCounts = Mapping[str, int] | Mapping[str | None, int]


@dataclass(frozen=True)
class Task:
    name: str
    classes: tuple[str, ...]
    mapping: dict[str, str]  # harmonised label -> class

    def class_of(self, label: str) -> str | None:
        return self.mapping.get(label)

    def index_of(self, label: str) -> int | None:
        cls = self.class_of(label)
        return None if cls is None else self.classes.index(cls)


_PNEUMONIA_ANY = ("pneumonia", "pneumonia/bacterial", "pneumonia/viral", "pneumonia/fungal", "pneumonia/other")

TASKS: Registry[Task] = Registry("task")


def register_task(task: Task, description: str) -> Task:
    return TASKS.add(task.name, task, f"{description}; classes: {', '.join(task.classes)}")


register_task(
    Task(
        "chest3",
        ("normal", "pneumonia", "covid-19"),
        {"normal": "normal", "covid-19": "covid-19", **{p: "pneumonia" for p in _PNEUMONIA_ANY}},
    ),
    "chest X-rays: normal, pneumonia of any cause, covid-19",
)
register_task(
    Task("pneumonia", ("normal", "pneumonia"), {"normal": "normal", **{p: "pneumonia" for p in _PNEUMONIA_ANY}}),
    "the Kaggle/Kermany pediatric benchmark: every pneumonia cause is pneumonia",
)
register_task(
    Task(
        "chest4",
        ("normal", "bacterial", "viral", "covid-19"),
        {"normal": "normal", "pneumonia/bacterial": "bacterial", "pneumonia/viral": "viral", "covid-19": "covid-19"},
    ),
    "chest X-rays by cause: pneumonia of unstated cause is dropped",
)
register_task(
    Task("oct", ("cnv", "dme", "drusen", "normal"), {f"oct/{c}": c for c in ("cnv", "dme", "drusen", "normal")}),
    "retinal OCT scans (the Kermany collection's other half)",
)


def get_task(name: str) -> Task:
    return TASKS.get(name)


def missing_classes(task: Task, counts: ClassCounts, where: str) -> str | None:
    """What is wrong when a class of `task` has no image in `counts` (class -> images), and what to do; None if none."""
    missing = [c for c in task.classes if not counts.get(c)]
    if not missing:
        return None
    present = {c for c in task.classes if counts.get(c)}
    fitting = [name for name in TASKS if name != task.name and set(TASKS.get(name).classes) <= present]
    instead = f" (e.g. --task {fitting[0]}: {', '.join(TASKS.get(fitting[0]).classes)})" if fitting else ""
    return (
        f"{where} has no {' and no '.join(repr(c) for c in missing)} image for task {task.name} "
        f"(classes {', '.join(task.classes)}), so a model trained on it would have an output trained on nothing. "
        f"Add a source with such images (`covidxray sources`), choose a task without that class{instead}, "
        "or map a source's finding to it with data.label_overrides"
    )


def require_every_class(task: Task, counts: ClassCounts, where: str) -> None:
    """UserError when a class of `task` has no image in `counts`: a model with an output it never saw trained
    would still print a probability for it."""
    message = missing_classes(task, counts, where)
    if message:
        raise UserError(message)
