"""A rich progress bar that library code advances through a plain callback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def progress_bar(label: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(label, total=total)

        def advance(done: int, new_total: int | None = None) -> None:
            if new_total is not None:
                progress.update(task, total=new_total)
            progress.advance(task, done)

        yield advance
