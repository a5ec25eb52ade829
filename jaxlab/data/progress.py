"""A Rich progress bar shaped as ``prepare``'s ``progress`` callback.

Usage::

    with rich_progress("tokenizing") as cb:
        store = prepare(cfg, tokenizer, cache_dir, progress=cb)

The bar goes to stderr so stdout stays clean for machine-readable output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@contextmanager
def rich_progress(
    description: str = "tokenizing",
    *,
    console: Console | None = None,
    transient: bool = False,
) -> Iterator[Callable[[int, int | None], None]]:
    """Show a byte-count progress bar; yield a ``(bytes_done, bytes_total_or_None)`` callback.

    An unknown total (``None``) shows a pulsing bar; a later call with a total fixes it.
    """
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        transient=transient,
    )
    task = progress.add_task(description, total=None)

    def update(done: int, total: int | None) -> None:
        progress.update(task, completed=done, total=total)

    with progress:
        yield update
