"""Headers parsed once per operation: a content-keyed cache that lives while a block runs.

Decoding a snapshot reads every shard header several times (folder validation, the target
check, the shard itself); parsing the same JSON again was about a tenth of decoding a small
model. The cache is keyed by content (the header bytes), so a file rewritten in between can
never be served a stale parse, whatever its timestamps say.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any


class _Parsed:
    """Parsed values shared while a `parse_once` block runs anywhere in the process."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, Hashable], Any] = {}
        self.users = 0
        self.lock = threading.Lock()


_PARSED = _Parsed()
_PARSED_MAX = 4096


@contextmanager
def parse_once() -> Iterator[None]:
    """Within this block, each distinct header is parsed only once.

    The parsed values are shared, so code inside the block must not modify them.
    """
    with _PARSED.lock:
        _PARSED.users += 1
    try:
        yield
    finally:
        with _PARSED.lock:
            _PARSED.users -= 1
            if _PARSED.users == 0:
                _PARSED.values.clear()


def parsed(kind: str, key: Hashable) -> Any:
    """The value `remember` stored for (`kind`, `key`) in a `parse_once` block, or None."""
    return _PARSED.values.get((kind, key)) if _PARSED.users else None


def remember(kind: str, key: Hashable, value: Any) -> None:
    """Keep `value` for (`kind`, `key`) while a `parse_once` block runs."""
    if _PARSED.users:
        if len(_PARSED.values) >= _PARSED_MAX:  # blocks that keep overlapping: stay bounded
            _PARSED.values.clear()
        _PARSED.values[(kind, key)] = value
