"""Bounded commands: every write the migration sends holds at most N documents and M bytes.

One `insert_many` of a whole batch can be a command of thousands of documents;
a slow server (the embedded one) then blocks for minutes and the driver gives
up. The migration cuts each write into commands of at most
`MAX_COMMAND_DOCUMENTS` documents and `MAX_COMMAND_BYTES` bytes of BSON (a
single larger document goes alone), well under MongoDB's 48 MB message limit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

MAX_COMMAND_DOCUMENTS = 200
MAX_COMMAND_BYTES = 4 * 1024 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class Bounds:
    """The most one write command holds."""

    documents: int = MAX_COMMAND_DOCUMENTS
    bytes: int = MAX_COMMAND_BYTES


def bounded(items: Sequence[T], sizes: Sequence[int], bounds: Bounds) -> Iterator[list[T]]:
    """`items` in runs of at most `bounds.documents` items and `bounds.bytes` bytes (by
    `sizes`); an item larger than the byte bound is a run of its own."""
    run: list[T] = []
    run_bytes = 0
    for item, size in zip(items, sizes, strict=True):
        if run and (len(run) >= bounds.documents or run_bytes + size > bounds.bytes):
            yield run
            run, run_bytes = [], 0
        run.append(item)
        run_bytes += size
    if run:
        yield run
