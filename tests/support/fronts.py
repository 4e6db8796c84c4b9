"""Serving ports that must answer the inference API only: processes to start (`hotload serve
--admin-port`, `hotload front`), each engine's admin requests, and the check that a port
refuses them.

A refusal is the serving port's own answer (404, error type `not_found`, "is not served on this
port"), never the engine's: an engine's own 404 (say, for an adapter it does not hold) would
mean the request reached it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from support.paths import REPO

#: One request per admin route, with bodies that would act if they reached the engine.
#: `{weights}` is replaced by a loadable snapshot folder.
REFERENCE_ADMIN: list[tuple[str, str, Any]] = [
    ("POST", "/hotload/v1/load", {"path": "{weights}", "identity": "intruder", "sequence": 99}),
    ("GET", "/hotload/v1/status", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": "{weights}"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "intruder"}),
]
#: vLLM 0.32's routes outside the inference API (dev mode and LoRA updating on): read from
#: `vllm/entrypoints` (routers registered by `register_api_routers`).
VLLM_ADMIN: list[tuple[str, str, Any]] = [
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    (
        "POST",
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": "{weights}"}},
    ),
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/release_kv_cache_memory", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/reset_mm_cache", None),
    ("POST", "/reset_encoder_cache", None),
    ("POST", "/update_weight_version", {"new_version": "intruder"}),
    ("GET", "/weight_info", None),
    ("POST", "/update_weights", {}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/finish_weight_update", {}),
    ("POST", "/init_weight_transfer_engine", {}),
    ("POST", "/abort_requests", {}),
    ("GET", "/server_info", None),
    ("POST", "/start_profile", None),
    ("POST", "/stop_profile", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": "{weights}"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "intruder"}),
    ("POST", "/scale_elastic_ep", {}),
    ("POST", "/inference/v1/abort_requests", {}),
    ("POST", "/v1/completions/render", {"prompt": "x"}),
    ("POST", "/invocations", {"prompt": [101], "max_tokens": 1}),
    ("GET", "/docs", None),
    ("GET", "/openapi.json", None),
]


def is_refusal(status: int, body: Any) -> bool:
    """Whether an answer is a serving port's refusal (and not the engine's own answer)."""
    if status != 404 or not isinstance(body, dict):
        return False
    err = body.get("error")
    return (
        isinstance(err, dict)
        and err.get("type") == "not_found"
        and "is not served on this port" in str(err.get("message"))
    )


async def admin_reachable(
    base: str, requests: list[tuple[str, str, Any]], weights: str
) -> list[str]:
    """The admin requests that `base` does NOT refuse ("METHOD PATH -> status"): empty for a
    serving port that passes the inference API only."""
    reached = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for method, path, body in requests:
            payload = _fill(body, weights)
            async with http.request(method, base + path, json=payload) as resp:
                try:
                    doc = await resp.json(content_type=None)
                except ValueError:
                    doc = None
                if not is_refusal(resp.status, doc):
                    reached.append(f"{method} {path} -> {resp.status}")
    return reached


def _fill(body: Any, weights: str) -> Any:
    if isinstance(body, dict):
        return {k: _fill(v, weights) for k, v in body.items()}
    if isinstance(body, str):
        return body.replace("{weights}", weights)
    return body


def free_port() -> int:
    """A TCP port free on loopback now, outside the kernel's ephemeral range."""
    from hotload.demo.processes import free_port as outside_ephemeral

    return outside_ephemeral()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


@dataclass
class Server:
    """A `hotload` subcommand running as a process (its own session, so its group is killed)."""

    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def start(self, ready_url: str, timeout: float = 120.0) -> Server:
        """Start it and wait until `ready_url` answers 200."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hotload", *self.args],
                cwd=REPO,
                env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited: {self.log_tail()}")
            with contextlib.suppress(OSError):
                if _status(ready_url) == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.args[0]} not ready in {timeout:g}s: {self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of its log."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def start_front(engine_url: str, log_path: Path, *extra: str) -> tuple[Server, str]:
    """`hotload front` for `engine_url` on a free loopback port; returns it and its URL."""
    port = free_port()
    server = Server(
        ["front", "--engine-url", engine_url, "--port", str(port), *extra], log_path
    ).start(f"http://127.0.0.1:{port}/front/healthz", timeout=60)
    return server, f"http://127.0.0.1:{port}"
