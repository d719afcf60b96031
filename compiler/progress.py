"""A byte-counting progress bar (rich) with throughput and ETA; a no-op when progress is off."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

FLUSH_BYTES = 8 << 20


@contextmanager
def byte_progress(enabled: bool, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yields `advance(nbytes)`. Output goes to stderr so stdout stays clean for scripts."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    pending = 0

    def advance(n: int) -> None:  # batched: the per-expert reads are many and small
        nonlocal pending
        pending += n
        if pending >= FLUSH_BYTES:
            bar.advance(task, pending)
            pending = 0

    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield advance
        bar.advance(task, pending)
