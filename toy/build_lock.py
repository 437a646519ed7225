"""One build at a time per asset folder: two runs started at once on a fresh clone (the README's
seeds 1 and 2 share runs/toy and runs/tiny/model) must not both build the toy set or the tiny
model into one folder. Each took the folder as absent, both wrote
toy/database/<db>/<db>.sqlite.tmp, and one run's rename found the other's file gone.

    with build_lock("runs/toy"):     # blocks while another process builds there
        if the set is absent or stale: build it
        # else: another run built it while this one waited, and it is reused

The lock is an exclusive fcntl.flock on a file beside the folder (runs/toy.lock: the folder's own
listing stays what the build writes). The kernel drops it when its holder exits, however it
exits (a crash, kill -9): a killed build never leaves it stuck, and the next run finds the
folder unfinished (the toy set writes train.jsonl last; a tiny model's stamp says "unfinished"
until its last file) and builds it again. Taken again by the process that holds it
(prepare_assets, then prepare_toy inside it), it is a no-op.
Tests: .venv/bin/pytest tests/test_tiny.py -k at_once
"""
from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

_held: dict[str, int] = {}  # lock file -> how many nested build_lock calls of this process hold it


def lock_path(folder: str | Path) -> Path:
    """The lock file of an asset folder: <folder>.lock beside it."""
    folder = Path(folder).resolve()
    return folder.with_name(folder.name + ".lock")


@contextlib.contextmanager
def build_lock(folder: str | Path) -> Iterator[None]:
    """Hold the folder's build lock inside the block, waiting (with one line said) while another
    process holds it."""
    path = lock_path(folder)
    key = str(path)
    if key in _held:  # this process holds it already: an inner build step
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:  # closing it releases the lock
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building {folder} (lock {path})", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
