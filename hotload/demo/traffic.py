"""The demo's traffic: one request in flight per replica for the whole run, each counted as
served or failed, and as during an update or not."""

from __future__ import annotations

import threading

from hotload.demo.policy import CORPUS
from hotload.demo.processes import Replica


class TrafficClient:
    """Keeps one request in flight per replica for the whole demo and counts the outcomes;
    a request counts as "during an update" if an update was in progress when it started or
    ended, or one started while it ran."""

    def __init__(self, replicas: list[Replica], max_tokens: int = 8, pause: float = 0.1) -> None:
        self.replicas = replicas
        self.max_tokens = max_tokens
        self.pause = pause
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._updating = False
        self._updates_started = 0
        self._threads: list[threading.Thread] = []
        self.requests = 0
        self.during_updates = 0
        self.failed = 0
        self.failed_during_updates = 0
        self.errors: list[str] = []
        self.per_replica: dict[str, list[int]] = {r.name: [0, 0] for r in replicas}  # ok, failed

    def start(self) -> None:
        """Start one client thread per replica."""
        for replica in self.replicas:
            t = threading.Thread(
                target=self._run, args=(replica,), name=f"traffic-{replica.name}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Stop the threads (each finishes its request in flight)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def begin_update(self) -> None:
        """A snapshot was published: the fleet is updating."""
        with self._lock:
            self._updating = True
            self._updates_started += 1

    def end_update(self) -> None:
        """Every replica serves the published snapshot."""
        with self._lock:
            self._updating = False

    def _run(self, replica: Replica) -> None:
        i = replica.index
        while not self._stop.is_set():
            prompt = CORPUS[i % len(CORPUS)][0]
            i += 1
            with self._lock:
                updating, started = self._updating, self._updates_started
            error = ""
            try:
                replica.complete(prompt, self.max_tokens, timeout=60)
            except OSError as err:  # refused, reset, timed out or a non-200 answer
                error = f"{replica.name}: {err}"
            with self._lock:
                during = updating or self._updating or started != self._updates_started
                self.requests += 1
                self.during_updates += during
                self.per_replica[replica.name][1 if error else 0] += 1
                if error:
                    self.failed += 1
                    self.failed_during_updates += during
                    if len(self.errors) < 5:
                        self.errors.append(error)
            self._stop.wait(self.pause)
