"""Which threads run a function a pool calls, for tests of a pool's size and thread names."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class ThreadsSeen:
    """Wraps `real`, noting the name of the thread of each call. With `pooled`, the first two
    calls wait for each other (a pool of two then holds both threads busy) and every call
    lingers `linger` seconds: a pool allowed more threads starts them for the later calls."""

    def __init__(self, real: Callable[..., Any], *, pooled: bool, linger: float) -> None:
        self.real = real
        self.pooled = pooled
        self.linger = linger
        self.names: list[str] = []
        self._lock = threading.Lock()
        self._both = threading.Barrier(2, timeout=30)

    def __call__(self, *args: Any) -> Any:
        """Note this call's thread, then call `real`."""
        with self._lock:
            first = len(self.names)
            self.names.append(threading.current_thread().name)
        if self.pooled and first < 2:
            self._both.wait()
        time.sleep(self.linger)
        return self.real(*args)

    def function(self) -> Callable[..., Any]:
        """This wrapper as a plain function: set on a class, it binds as the method it replaces."""

        def call(*args: Any) -> Any:
            return self(*args)

        return call
