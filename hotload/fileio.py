"""File operations that several layers share: a positional write that writes everything, and a
directory sync that makes a rename durable."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def pwrite_all(fd: int, data: bytes | memoryview | np.ndarray, offset: int) -> None:
    """Write all of `data` at `offset` of an open file (one pwrite may write less than asked)."""
    view = data.view(np.uint8).data if isinstance(data, np.ndarray) else memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view = view[done:]
        offset += done


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk, so that a file renamed into it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
