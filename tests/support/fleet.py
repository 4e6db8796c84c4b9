"""Replicas for end-to-end tests: a loader process and a reference-engine process per replica,
and a trainer that publishes a chain (a full snapshot every N steps, arc_v2 deltas between).

Everything here is a real process talking HTTP: `python -m hotload_sidecar` and
`python -m hotload serve`, both from this repo, on loopback ports; `VLLMReplica` runs a real vLLM
CPU server (`.venv-vllm/`) as the engine instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hotload.arc import encode
from hotload.ledger import Ledger, LedgerEntry
from hotload.sdk import publish_folder
from support.paths import REPO


def free_port() -> int:
    """A TCP port free on loopback now, outside the kernel's ephemeral range (a port from
    `bind(0)` can go to an outgoing connection before a server started later binds it)."""
    from hotload.demo.processes import free_port as outside_ephemeral

    return outside_ephemeral()


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP request; returns (status, parsed JSON or text). Connection errors raise OSError."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def run_on_a_terminal(
    args: list[str], env: dict[str, str], timeout: float = 120.0
) -> tuple[int, str, str]:
    """Run `args` with stderr on a pseudo-terminal (as a person at a shell sees it); return
    (exit code, stdout, what the terminal received, escape codes included)."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            args, cwd=REPO, env={**env, "COLUMNS": "120"}, stdout=subprocess.PIPE, stderr=slave
        )
    finally:
        os.close(slave)
    import select

    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Call `check` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as err:
            last = err
        if last and not isinstance(last, OSError):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")


def publish_corrupted_delta(
    ledger: Ledger, parent: Path, child: Path, folder: Path, *, identity: str, parent_identity: str
) -> None:
    """Publish the delta `parent` -> `child` (encoded into `folder`) as `identity`, with one
    byte of its largest shard flipped (corrupted before it was published): a loader refuses it."""
    encode(parent, child, folder, parent_identity=parent_identity)
    shard = max(folder.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    publish_folder(ledger, folder, identity=identity)


@dataclass
class Trainer:
    """Publishes step `i` of a list of full snapshot folders as identity `step-<i>`: the folder
    itself every `full_every` steps, an arc_v2 delta against step i-1 otherwise."""

    ledger: Ledger
    fulls: list[Path]
    workdir: Path
    full_every: int = 4
    published: list[LedgerEntry] = field(default_factory=list)

    @staticmethod
    def identity(step: int) -> str:
        """The identity of step `step`."""
        return f"step-{step:03d}"

    def publish(
        self,
        step: int,
        *,
        full: bool | None = None,
        folder: Path | None = None,
        compact: bool = False,
    ) -> Path:
        """Publish step `step` (or `folder` under its identity); return what was uploaded.
        `compact`: a delta encoded with `sparse_exp` (its positions follow the parent's
        exponents)."""
        ident = self.identity(step)
        if folder is None:
            as_full = step % self.full_every == 0 if full is None else full
            if as_full:
                folder = self.workdir / "full" / ident
                if not folder.exists():
                    folder.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(self.fulls[step], folder)
            else:
                folder = self.workdir / "delta" / ident
                if not folder.exists():
                    encode(
                        self.fulls[step - 1],
                        self.fulls[step],
                        folder,
                        parent_identity=self.identity(step - 1),
                        threads=1,
                        compact=compact,
                    )
        entry = publish_folder(self.ledger, folder, identity=ident).entry
        self.published.append(entry)
        return folder


@dataclass
class Replica:
    """One replica: a loader process and (once the loader started) a reference engine."""

    name: str
    root: Path
    ledger_url: str
    env: dict[str, str]
    loader_args: list[str] = field(default_factory=list)
    engine_port: int = field(default_factory=free_port)
    loader_port: int = field(default_factory=free_port)
    #: With a port, as in the operator's pods: the engine serves its full API on it (loopback)
    #: and only the inference API on `engine_port`; the loader uses the full one.
    admin_port: int | None = None
    #: More `hotload serve` options (e.g. `--scrub-bytes-per-second 0`).
    engine_args: list[str] = field(default_factory=list)
    #: False: the engine boots from the snapshot `current` names, not through the link, so it
    #: serves that snapshot until the loader patches it, as vLLM does (`hotload/engine/boot.py`
    #: patches a reference engine booted through the link forward itself).
    boot_forward: bool = True
    loader: subprocess.Popen[bytes] | None = None
    engine: subprocess.Popen[bytes] | None = None
    #: The engine's readiness probe (the operator's pod template: `/ready` for the reference
    #: engine, `/health` for vLLM).
    ready_path: ClassVar[str] = "/ready"

    @property
    def weights(self) -> Path:
        """The weights folder shared by the loader and the engine."""
        return self.root / "weights"

    @property
    def engine_url(self) -> str:
        """The engine's base URL."""
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def full_api_url(self) -> str:
        """Where the loader reaches the engine: the admin port when there is one."""
        port = self.engine_port if self.admin_port is None else self.admin_port
        return f"http://127.0.0.1:{port}"

    @property
    def loader_url(self) -> str:
        """The loader's base URL."""
        return f"http://127.0.0.1:{self.loader_port}"

    def start_loader(self) -> None:
        """Start `python -m hotload_sidecar` for this replica."""
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "loader.log", "ab")  # noqa: SIM115 - owned by the process
        self.loader = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hotload_sidecar",
                "--ledger-url",
                self.ledger_url,
                "--weights-dir",
                str(self.weights),
                "--engine-url",
                self.full_api_url,
                "--listen",
                f"127.0.0.1:{self.loader_port}",
                "--poll-seconds",
                "0.3",
                "--retry-seconds",
                "1",
                "--threads",
                "1",
                "--engine-wait-seconds",
                "120",
                *self.loader_args,
            ],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start_engine(self) -> None:
        """Start the reference engine on `weights/current` (as the pod's engine container)."""
        log = open(self.root / "engine.log", "ab")  # noqa: SIM115
        current = self.weights / "current"
        self.engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hotload",
                "serve",
                "--model",
                str(current if self.boot_forward else current.resolve()),
                "--name",
                "tiny",
                "--port",
                str(self.engine_port),
                "--max-batch",
                "4",
                *([] if self.admin_port is None else ["--admin-port", str(self.admin_port)]),
                *self.engine_args,
            ],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start(self, timeout: float = 120.0) -> None:
        """Loader first; the engine once `/startup` answers 200 (the startup probe)."""
        self.start_loader()
        self.wait_started(timeout)
        self.start_engine()

    def wait_started(self, timeout: float = 120.0) -> None:
        """Wait for the loader's startup endpoint."""

        def started() -> bool:
            self._alive()
            return http_json("GET", self.loader_url + "/startup", timeout=5)[0] == 200

        wait_for(f"{self.name} loader start-up", started, timeout)

    def status(self) -> dict[str, Any]:
        """The loader's status document."""
        code, body = http_json("GET", self.loader_url + "/status", timeout=10)
        assert code == 200, body
        return dict(body)

    def metrics(self) -> str:
        """The loader's Prometheus metrics text."""
        with urllib.request.urlopen(self.loader_url + "/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def wait_serving(self, identity: str, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until the loader reports the engine serving `identity`; return the status."""

        def serving() -> dict[str, Any] | None:
            self._alive()
            doc = self.status()
            return doc if doc["identity"] == identity and doc["state"] == "idle" else None

        result: dict[str, Any] = wait_for(f"{self.name} serving {identity}", serving, timeout)
        return result

    def wait_polls(self, count: int, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the loader has polled the ledger `count` more times (each poll stamps
        `last_poll_time`); return the status after the last. For checks that something did
        *not* happen: a number of polls, not a number of seconds, however busy the machine."""
        seen: list[str] = []

        def polled() -> dict[str, Any] | None:
            self._alive()
            doc = self.status()
            stamp = doc.get("last_poll_time")
            if stamp and (not seen or seen[-1] != stamp):
                seen.append(stamp)
            # The first stamp seen may be from a poll before the call.
            return doc if len(seen) > count else None

        result: dict[str, Any] = wait_for(f"{self.name} polling {count} times", polled, timeout)
        return result

    def complete(self, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        """A greedy completion from the engine (token ids included)."""
        code, body = http_json(
            "POST",
            self.engine_url + "/v1/completions",
            {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True},
        )
        assert code == 200, body
        return dict(body)

    def complete_ids(self, prompt_ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """A greedy completion of a token-id prompt."""
        code, body = http_json(
            "POST",
            self.engine_url + "/v1/completions",
            {"prompt": prompt_ids, "max_tokens": max_tokens, "return_token_ids": True},
        )
        assert code == 200, body
        return dict(body)

    def pause_loader(self) -> None:
        """SIGSTOP the loader: it reads nothing until `resume_loader` (a slow replica); the
        engine keeps serving."""
        if self.loader is not None and self.loader.poll() is None:
            self.loader.send_signal(signal.SIGSTOP)

    def resume_loader(self) -> None:
        """SIGCONT a paused loader."""
        if self.loader is not None and self.loader.poll() is None:
            self.loader.send_signal(signal.SIGCONT)

    def kill_loader(self) -> None:
        """SIGKILL the loader (no clean-up runs)."""
        if self.loader is not None and self.loader.poll() is None:
            self.loader.kill()
            self.loader.wait(timeout=30)

    def kill_engine(self) -> None:
        """SIGKILL the engine (an engine container crash); `start_engine` boots it again from
        `weights/current`."""
        if self.engine is not None and self.engine.poll() is None:
            self.engine.kill()
            self.engine.wait(timeout=30)

    def stop(self) -> None:
        """Stop both processes (SIGTERM, then SIGKILL)."""
        for proc in (self.loader, self.engine):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused process handles SIGTERM only then
                proc.send_signal(signal.SIGTERM)
        for proc in (self.loader, self.engine):
            if proc is None:
                continue
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def engine_processes(self) -> dict[str, int]:
        """The engine's running processes by role ("engine": the one serving HTTP)."""
        if self.engine is None or self.engine.poll() is not None:
            return {}
        return {"engine": self.engine.pid}

    def served_checksums(self, timeout: float = 60.0) -> tuple[int, dict[str, Any] | str]:
        """(HTTP status, `{"identity", "checksums"}`) of the weights the engine holds, read
        together (`GET /hotload/v1/checksums`); the answer's text on a status other than 200.
        Connection errors raise OSError."""
        code, body = http_json("GET", self.full_api_url + "/hotload/v1/checksums", timeout=timeout)
        return (code, body) if code == 200 and isinstance(body, dict) else (code, str(body))

    def logs(self) -> str:
        """The tail of both logs, for assertion messages."""
        out = []
        for name in ("loader.log", "engine.log"):
            path = self.root / name
            if path.exists():
                out.append(
                    f"--- {self.name} {name} ---\n" + path.read_text(errors="replace")[-4000:]
                )
        return "\n".join(out)

    def _alive(self) -> None:
        for what, proc in (("loader", self.loader), ("engine", self.engine)):
            if proc is not None and proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} {what} exited with {proc.returncode}\n{self.logs()}"
                )


@dataclass
class VLLMReplica(Replica):
    """A replica whose engine is a real vLLM CPU server (`.venv-vllm/`, `support.vllm_server`)
    with the hotload worker extension the loader (`--engine vllm`) copies to the volume, booted
    from `weights/current` as the operator's vLLM pod boots it. `start_engine` does not wait for
    the 70-100 s boot (a kubelet does not either): the loader waits for the engine."""

    ready_path: ClassVar[str] = "/health"
    #: The name vLLM serves the model under (`--served-model-name`).
    served_name: str = "tiny"

    def __post_init__(self) -> None:
        if "--engine" not in self.loader_args:
            self.loader_args = ["--engine", "vllm", *self.loader_args]

    def start_engine(self) -> None:
        """Start vLLM on `weights/current` with the extension on its PYTHONPATH, in its own
        process group (the API server and its engine core: one container to kill)."""
        from hotload.api.names import ENGINE_PYTHONPATH_DIR, VLLM_WORKER_EXTENSION
        from support.vllm_server import INSTALL_HINT, vllm_command, vllm_env, vllm_python

        python = vllm_python()
        if python is None:
            raise AssertionError(INSTALL_HINT)
        extension = str(self.weights / ENGINE_PYTHONPATH_DIR)
        args = ("--worker-extension-cls", VLLM_WORKER_EXTENSION, "--enforce-eager")
        log = open(self.root / "engine.log", "ab")  # noqa: SIM115 - owned by the process
        # Started outside the repository: `python -m` puts its working directory first on the
        # path, which would import this checkout's hotload_patch instead of the volume's copy.
        self.engine = subprocess.Popen(
            [
                *vllm_command(python, self.weights / "current", self.engine_port, args),
                "--served-model-name",
                self.served_name,
            ],
            cwd=self.root,
            env=vllm_env(1, {"PYTHONPATH": extension}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_engine(self) -> None:
        """SIGKILL the engine's whole process group (the container crashes: its engine core
        goes with it)."""
        if self.engine is not None:
            self._end_engine(signal.SIGKILL)

    def _end_engine(self, sig: signal.Signals) -> None:
        assert self.engine is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.engine.pid, sig)
        try:
            self.engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.engine.pid, signal.SIGKILL)
            self.engine.wait(timeout=10)
        # The engine core can outlive the API server: the group goes either way.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.engine.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop the engine's process group (SIGTERM, then SIGKILL), then the loader."""
        if self.engine is not None:
            self._end_engine(signal.SIGTERM)
        super().stop()

    def engine_processes(self) -> dict[str, int]:
        """The API server ("engine") and, once started, its engine core ("engine-core") and
        model worker ("engine-worker", which holds the weights)."""
        from support.vllm_server import engine_processes

        out = super().engine_processes()
        return {**out, **engine_processes(out["engine"])} if out else out

    def weight_version(self, timeout: float = 10.0) -> str | None:
        """The weight version vLLM serves (`GET /weight_info`): the identity the loader set
        after its last load, `default` for the weights it booted with; None when not answered.
        Connection errors raise OSError."""
        code, body = http_json("GET", self.engine_url + "/weight_info", timeout=timeout)
        version = body.get("weight_version") if code == 200 and isinstance(body, dict) else None
        return version if isinstance(version, str) else None

    def paused(self, timeout: float = 10.0) -> bool | None:
        """Whether vLLM is paused (a load in progress), None when not answered."""
        code, body = http_json("GET", self.engine_url + "/is_paused", timeout=timeout)
        value = body.get("is_paused") if code == 200 and isinstance(body, dict) else None
        return value if isinstance(value, bool) else None

    def served_checksums(self, timeout: float = 60.0) -> tuple[int, dict[str, Any] | str]:
        """`Replica.served_checksums` for vLLM: the extension's per-parameter sha256 (vLLM's
        fused layout) between two reads of the weight version, both unpaused and equal (a load
        pauses vLLM and sets the version before it resumes, so equal unpaused reads around the
        checksums mean no load ran under them); tried again while a load runs."""
        deadline = time.monotonic() + timeout
        last = "no read"
        while time.monotonic() < deadline:
            before = self.weight_version(), self.paused()
            code, body = http_json(
                "POST",
                self.engine_url + "/collective_rpc",
                {"method": "hotload_parameter_checksums", "args": [], "kwargs": {}},
                timeout=timeout,
            )
            after = self.weight_version(), self.paused()
            results = body.get("results") if code == 200 and isinstance(body, dict) else None
            if not isinstance(results, list) or not results or not isinstance(results[0], dict):
                return code, f"collective_rpc hotload_parameter_checksums: {str(body)[:300]}"
            if before == after and before[1] is False:
                return 200, {"identity": before[0], "checksums": results[0].get("checksums")}
            last = f"weight version/paused {before} before, {after} after"
            time.sleep(0.5)
        return 0, f"no read outside a load within {timeout:g}s ({last})"


#: A prompt as token ids of the tiny Llama's WordPiece vocabulary (`support.tiny_llm`).
PROMPT_IDS = [101, 1996, 7570, 2001, 2019, 2214, 102]


def tokens(replica: Replica, max_tokens: int = 8) -> tuple[str, list[int]]:
    """The model name and the greedy token ids `replica` answers `PROMPT_IDS` with."""
    body = replica.complete_ids(PROMPT_IDS, max_tokens)
    return body["model"], list(body["choices"][0]["token_ids"])


async def wait_until(
    what: str, check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02
) -> Any:
    """`wait_for` in an event loop (what runs in the loop goes on meanwhile): await until
    `check()` returns something truthy and return it, else fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
    return got
