"""The soak: a trainer process publishing hundreds of steps to a real SeaweedFS, replicas (loader
`python -m hotload_sidecar` + reference engine `hotload serve`, the last `SoakConfig.vllm` of
them a real vLLM CPU engine with its loader `--engine vllm`) following it, retention after
every publish, the operator's two replicas on a real API server (`soak_cluster`: a
HotLoadDeployment on the soak's ledger, one pod per replica that its loader reports to and whose
head handoff it follows), and a seeded schedule of overlapping faults (`soak_faults`).

`run_soak(SoakConfig(...))` runs it and returns a `SoakRun`: everything measured, per step and
per replica, which `soak_checks.evaluate` turns into the checks. `benchmarks/soak.py` is the
long form (results to RESULTS-soak.md), `tests/test_soak.py` the short one.

A vLLM replica is judged like the others, read its own way: its clients pair each completion with
vLLM's weight version (`GET /weight_info`, read before and after it, equal: vLLM's answers do not
name the weights), an answer from the weights it booted with (version `default`, until its loader
loads and names them) is counted apart (`SoakRun.unversioned`); its weights are read back through
the hotload extension's per-parameter sha256 and compared with the trainer's in vLLM's layout
(`soak_trainer.vllm_sha256s`); its RSS and fds are sampled for the API server, the engine core and
the model worker; a killed vLLM boots again (70-100 s) while the soak goes on, as a kubelet
restarts a container, and its loader waits for it. The first engine and loader kill of the schedule
go to a vLLM replica (`retarget`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotload.api.names import REASON_ENGINE_DOWN
from support.fleet import PROMPT_IDS, Replica, VLLMReplica, http_json
from support.fronts import Server, start_front
from support.paths import REPO
from support.seaweedfs import SeaweedFS
from support.soak_cluster import ClusterRecord, ClusterSample, Deposal, SoakCluster
from support.soak_faults import (
    CORRUPT_WORDS,
    FULL_WORDS,
    LEADER_KINDS,
    Fault,
    schedule,
    status_words,
)
from support.soak_trainer import identity as step_identity
from support.vllm_server import START_TIMEOUT, write_tiny_llama

TESTS = REPO / "tests"
#: The longest a frozen leader stays frozen waiting for the standby to take the Lease.
FREEZE_CAP = 120.0
#: The longest the soak waits after corrupting an object for a loader to name it (a head's
#: handoff and a delta's download and check take seconds; a minute means a loader stuck).
CORRUPT_READ_SECONDS = 60.0
#: A `slow_bucket` window lasts until the slow door has held this many requests (at most
#: SLOW_CAP_FACTOR times its length: then its check says how few it held).
SLOW_MIN_HELD = 2
SLOW_CAP_FACTOR = 4.0
#: The most steps a full volume stays full past its end while its loader has written nothing.
FULL_HOLD = 30
#: The files of the soak's model besides its weights (the trainer's `side_files_from`).
SIDE_FILES = (
    "config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    "vocab.txt",
)  # fmt: skip


@dataclass
class SoakConfig:
    """What to run: `steps` published (a full snapshot every `full_every`), `replicas`
    replicas (the last `vllm` of them vLLM CPU engines), the bucket's retention (`retain`: the
    Publisher's `retain=`), the object store stopped for `outage_seconds` per outage, idle CPU
    over `idle_seconds` at the end."""

    root: Path
    steps: int = 300
    seed: int = 0
    replicas: int = 3
    #: How many of the replicas (the last ones) run a vLLM CPU engine instead of the reference.
    vllm: int = 0
    full_every: int = 25
    retain: int = 8
    #: How long the Publisher keeps the files of an entry it dropped (its `retain_grace`,
    #: default 10 minutes): a run shorter than it never sees retention delete a file.
    retain_grace: float = 600.0
    outage_seconds: float = 30.0
    idle_seconds: float = 30.0
    #: Chance per step of comparing one replica's served weights with the trainer's.
    spot_check_rate: float = 0.15
    converge_timeout: float = 600.0
    #: The API server stopped for this long per `apiserver_restart`.
    apiserver_outage_seconds: float = 10.0
    #: Per `slow_bucket`: how long deployment `slow`'s bucket is slow, holding each request
    #: `slow_delay` seconds (the operator reads each ledger within 30 s, then abandons it).
    slow_seconds: float = 60.0
    slow_delay: float = 20.0


@dataclass
class Published:
    """One step as the trainer reported it."""

    step: int
    identity: str
    kind: str
    sha256: dict[str, str]
    #: The same weights' sha256 in vLLM's layout (fused projections, padded vocabulary).
    vllm_sha256: dict[str, str]
    full_bytes: int
    shipped_bytes: int
    sent: float  # monotonic time the publish was asked for
    done: float  # monotonic time the trainer answered
    attempts: int
    resumed: bool
    #: When the ledger append landed (wall clock, Unix seconds; None: not reported).
    landed: float | None = None


@dataclass
class Sample:
    """What was measured after publishing one step."""

    step: int
    time: float
    #: (replica, "loader"|"engine") -> (pid, RSS bytes, open fds, of them sockets); absent when
    #: not running.
    procs: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    #: replica -> bytes of its weights folder (hard links counted once).
    volume: dict[str, int] = field(default_factory=dict)
    #: replica -> those bytes by entry (`folder_bytes`): the evidence when a look is over the
    #: volume's bound (the 200-step run had two such looks that nothing then could explain).
    volume_entries: dict[str, dict[str, int]] = field(default_factory=dict)
    #: replica -> bytes of those under .hotload/early (snapshots fetched before admission).
    early: dict[str, int] = field(default_factory=dict)
    #: replica -> entries in .hotload/staging and .hotload/downloads while it was idle on
    #: the same snapshot before and after the look.
    staging_idle: dict[str, list[str]] = field(default_factory=dict)
    #: replica -> loader status (state, identity, reason, last_error).
    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Objects and bytes under the soak's prefix, and its snapshot folders (None: store down).
    bucket_objects: int | None = None
    bucket_bytes: int | None = None
    bucket_folders: list[str] | None = None
    #: The HotLoadDeployment and the Lease's holder, read before the loaders' statuses.
    cluster: ClusterSample | None = None


@dataclass
class SpotCheck:
    """One comparison of a replica's served weights with the trainer's record."""

    step: int
    replica: str
    identity: str | None
    mismatched: list[str]
    error: str | None = None


@dataclass
class SoakRun:
    """Everything one soak measured."""

    config: SoakConfig
    faults: list[Fault]
    published: dict[int, Published] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    #: replica -> [(monotonic time, step served)] as a client saw the answers.
    served: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    client_errors: dict[str, int] = field(default_factory=dict)
    unknown_identities: list[str] = field(default_factory=list)
    spot_checks: list[SpotCheck] = field(default_factory=list)
    final_checksums: dict[str, dict[str, str]] = field(default_factory=dict)
    final_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    converged_seconds: float | None = None
    converge_error: str | None = None
    #: component -> % of one core over the idle window.
    idle_cpu: dict[str, float] = field(default_factory=dict)
    #: What each fault did, as observed (times, errors seen, statuses naming it).
    fault_log: list[str] = field(default_factory=list)
    #: replica -> loader statuses seen while a corrupted object was in force.
    corrupt_statuses: list[dict[str, Any]] = field(default_factory=list)
    volume_full_statuses: list[dict[str, Any]] = field(default_factory=list)
    #: replica -> monotonic times its engine process was started (boot included).
    engine_starts: dict[str, list[float]] = field(default_factory=dict)
    wall_seconds: float = 0.0
    #: Why the soak stopped before its last step (None: it ran to the end).
    aborted: str | None = None
    base_bytes: int = 0
    #: What the control plane showed (the operator's status, leader changes, Events).
    cluster: ClusterRecord | None = None
    #: replica -> its pod's name.
    pods: dict[str, str] = field(default_factory=dict)
    #: The replicas whose engine is vLLM.
    vllm: set[str] = field(default_factory=set)
    #: replica -> answers from weights no loader had named yet (vLLM's `default` version after
    #: a boot): which snapshot answered is unknown, so they are not in `served`.
    unversioned: dict[str, int] = field(default_factory=dict)
    #: The fault schedule's changes for the vLLM replicas (`retarget`).
    retargeted: list[str] = field(default_factory=list)
    #: Wall-clock time minus monotonic time (the audit log's clock from the soak's).
    wall_offset: float = field(default_factory=lambda: time.time() - time.monotonic())
    #: Wall-clock (stopped, answering again) of each object-store outage.
    store_down: list[tuple[float, float]] = field(default_factory=list)

    def expected(self, name: str, published: Published) -> dict[str, str]:
        """The sha256 replica `name`'s engine must report for `published`'s weights, by the
        names that engine reports them under."""
        # A run pickled before vLLM replicas existed has neither field.
        vllm = getattr(self, "vllm", set())
        return published.vllm_sha256 if name in vllm else published.sha256


# --- /proc ------------------------------------------------------------------------------------


def proc_usage(pid: int) -> tuple[int, int, int] | None:
    """(RSS bytes, open file descriptors, how many of them are sockets) of `pid`, None when it
    is gone."""
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        fds = os.listdir(f"/proc/{pid}/fd")
        sockets = 0
        for fd in fds:
            with contextlib.suppress(OSError):  # closed while we looked
                sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
        return rss, len(fds), sockets
    except (OSError, ValueError):
        return None


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of `pid` in clock ticks, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def folder_bytes(root: Path, by_entry: dict[str, int] | None = None) -> int:
    """Allocated bytes of the files under `root` (each inode once: hard links share); with
    `by_entry`, also the bytes each inode was first met under, by the top-level entry (and
    `.hotload/<sub>/<entry>`) it lies in: what a volume over its bound holds."""
    seen: set[int] = set()
    total = 0
    for dirpath, _dirs, files in sorted(os.walk(root)):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue  # removed while walking
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
                if by_entry is not None:
                    key = _entry_of(Path(dirpath, name).relative_to(root))
                    by_entry[key] = by_entry.get(key, 0) + st.st_size
    return total


def _entry_of(rel: Path) -> str:
    """The folder a file of a volume lies in, to one level below the top (`snapshots/<id>`),
    two under `.hotload` (`.hotload/downloads/<step>`); a file at the top is its own entry."""
    parts = rel.parts
    depth = 3 if parts[0] == ".hotload" else 2  # snapshots/<id>, .hotload/<work>/<entry>
    return "/".join(parts[: min(depth, len(parts) - 1) or 1])


# --- the trainer process ----------------------------------------------------------------------


class TrainerProcess:
    """`python -m support.soak_trainer`: asked to publish one step at a time over stdin."""

    def __init__(
        self, url: str, model: tuple[Path, Path], root: Path, cfg: SoakConfig, env: dict[str, str]
    ) -> None:
        base, side = model
        self.args = [
            sys.executable, "-m", "support.soak_trainer", url, str(base), str(side),
            str(root / "work"), "--full-every", str(cfg.full_every), "--retain", str(cfg.retain),
            "--retain-grace", str(cfg.retain_grace), "--seed", str(cfg.seed),
        ]  # fmt: skip
        self.env = {**env, "PYTHONPATH": os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])}
        self.log = root / "trainer.log"
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def start(self, timeout: float = 300.0) -> None:
        """Start the process and wait until its Publisher is open."""
        self.lines = queue.Queue()
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                self.args, cwd=REPO, env=self.env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True,
            )  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()
        answer = self.answer(timeout)
        if not answer.get("ready"):
            raise AssertionError(f"the soak trainer did not start: {answer}")

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def ask(self, step: int) -> None:
        """Ask for step `step` to be published."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float) -> dict[str, Any]:
        """The trainer's next answer."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the soak trainer did not answer in {timeout:g}s") from None
        if line is None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the soak trainer exited\n{tail}")
        return dict(json.loads(line))

    def kill(self) -> None:
        """SIGKILL (no clean-up)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        """Close stdin (the trainer ends), then make sure."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


# --- clients ----------------------------------------------------------------------------------


class Clients:
    """One client thread per replica asking its engine for a 1-token completion all along and
    recording which snapshot answered."""

    def __init__(self, replicas: list[Replica], run: SoakRun, urls: dict[str, str]) -> None:
        self.replicas = replicas
        self.run = run
        #: Where each replica's clients ask (its engine, or the front before a vLLM engine).
        self.urls = urls
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._one, args=(r,), daemon=True) for r in replicas
        ]
        for r in replicas:
            run.served[r.name] = []
            run.client_errors[r.name] = 0

    def start(self) -> None:
        """Start the threads."""
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Stop the threads."""
        self.stopping.set()
        for t in self.threads:
            t.join(60)

    def _one(self, r: Replica) -> None:
        body: dict[str, Any] = {"prompt": PROMPT_IDS, "max_tokens": 1, "return_token_ids": True}
        if isinstance(r, VLLMReplica):
            body["model"] = r.served_name
        while not self.stopping.is_set():
            try:
                ident: str | None = None
                if isinstance(r, VLLMReplica):
                    code, ident = self._vllm_answer(r, self.urls[r.name], body)
                else:
                    code, answer = http_json(
                        "POST", self.urls[r.name] + "/v1/completions", body, timeout=30
                    )
                    if code == 200 and isinstance(answer, dict):
                        ident = str(answer.get("model", ""))
            except OSError:
                code, ident = 0, None
            if code == 200 and ident is not None:
                self._record(r.name, ident)
            elif code != -1:
                self.run.client_errors[r.name] += 1
                time.sleep(0.2)
            time.sleep(0.05)

    @staticmethod
    def _vllm_answer(r: VLLMReplica, url: str, body: dict[str, Any]) -> tuple[int, str | None]:
        """A completion from vLLM and the weights that answered it, as `tiny@<version>`: the
        weight version read before and after it (a load sets it while vLLM is paused, so equal
        reads mean one version answered); code -1 when a load ran in between (asked again)."""
        before = r.weight_version()
        code, answer = http_json("POST", url + "/v1/completions", body, timeout=30)
        if code != 200 or not isinstance(answer, dict) or not answer.get("choices"):
            return code or 0, None
        after = r.weight_version()
        if before is None or before != after:
            return -1, None
        return 200, f"{r.served_name}@{before}"

    def _record(self, name: str, model: str) -> None:
        ident = model.partition("@")[2]
        if ident.startswith("step-") and ident[5:].isdigit():
            self.run.served[name].append((time.monotonic(), int(ident[5:])))
        elif name in self.run.vllm and ident == "default":
            self.run.unversioned[name] = self.run.unversioned.get(name, 0) + 1
        else:
            self.run.unknown_identities.append(f"{name}: {model}")


# --- the soak ---------------------------------------------------------------------------------


class Soak:
    """The processes of one soak and the fault actions on them."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed + 1)
        if not 0 <= cfg.vllm <= cfg.replicas:
            raise ValueError(f"vllm={cfg.vllm}: must be between 0 and replicas={cfg.replicas}")
        self.run = SoakRun(cfg, schedule(cfg.steps, cfg.seed, cfg.full_every, cfg.replicas))
        self.run.vllm = {f"r{i}" for i in range(cfg.replicas - cfg.vllm, cfg.replicas)}
        self.run.retargeted = retarget(self.run.faults, cfg.replicas - cfg.vllm, cfg.replicas)
        self.seaweed: SeaweedFS | None = None
        self.seaweed_up = threading.Event()
        self.replicas: list[Replica] = []
        self.trainer: TrainerProcess | None = None
        self.clients: Clients | None = None
        #: The engine front of each vLLM replica, as its pod has one (`hotload front`, reading
        #: the loader's serving gate): the clients ask through it.
        self.fronts: dict[str, Server] = {}
        self.prefix = f"soak-{uuid.uuid4().hex[:8]}"
        self.limited: dict[int, int] = {}  # replica -> loader pid under RLIMIT_FSIZE
        self.store: Any = None
        #: The step and time an outage began, until the store is started again.
        self.outage: tuple[int, float] | None = None
        self.cluster: SoakCluster | None = None
        #: The step and time the API server was stopped, until it is started again.
        self.api_outage: tuple[int, float] | None = None
        #: The step, time and requests held so far when deployment `slow`'s bucket turned
        #: slow, until it answers at once again.
        self.slow: tuple[int, float, int] | None = None
        #: Operator identities a fault keeps down (not restarted by `supervise`).
        self.operators_down: set[str] = set()
        #: The frozen (or cut-off) leader's deposal, until it is woken (or healed).
        self.frozen: Deposal | None = None
        #: The killed leader's deposal, until it is started again: not before its fault ended
        #: and another replica took the Lease (or FREEZE_CAP passed). Started at once, it took
        #: its own Lease back under the same identity, and the soak then timed a "takeover"
        #: that was the next API-server restart's (114.6 s in the 200-step run).
        self.killed: Deposal | None = None
        self.kill_ended = False

    # --- set-up and tear-down --------------------------------------------------------------

    def start(self) -> None:
        """The base model, SeaweedFS, the trainer with step 0 published, the replicas."""
        root = self.cfg.root
        # A tiny Llama vLLM's CPU attention serves (head_dim 32), for every replica alike.
        base = write_tiny_llama(root / "model" / "base", self.cfg.seed)
        side = root / "model" / "_side_files"
        side.mkdir(parents=True, exist_ok=True)
        for name in SIDE_FILES:
            (side / name).write_bytes((base / name).read_bytes())
        self.run.base_bytes = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        self.seaweed = SeaweedFS.start(root / "seaweed")
        self.seaweed_up.set()
        self.store = self.seaweed.store(timeout="20s")
        env = {**os.environ, **self.seaweed.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        url = self.seaweed.url(self.prefix)
        self.trainer = TrainerProcess(url, (base, side), root / "trainer", self.cfg, env)
        (root / "trainer").mkdir(parents=True, exist_ok=True)
        self.trainer.start()
        self.publish(0)
        self.cluster = SoakCluster(root, env, url, self.cfg.replicas)
        self.run.cluster = self.cluster.record
        pods = self.cluster.start()
        for i in range(self.cfg.replicas):
            args = self.cluster.loader_args(pods[i], root / f"r{i}")
            kind = VLLMReplica if f"r{i}" in self.run.vllm else Replica
            self.replicas.append(kind(f"r{i}", root / f"r{i}", f"{url}/policy", env, args))
            self.run.pods[f"r{i}"] = pods[i]
        for r in self.replicas:
            r.start_loader()
        for r in self.replicas:
            r.wait_started(300)
            self.start_engine(r)
        for r in self.replicas:
            # vLLM boots in 70-100 s on 2 idle cores (HOTLOAD_VLLM_START_TIMEOUT for slower).
            r.wait_serving(step_identity(0), START_TIMEOUT if r.name in self.run.vllm else 300)
        urls = {r.name: r.engine_url for r in self.replicas}
        for r in self.replicas:
            if isinstance(r, VLLMReplica):
                gate = ("--gate-url", r.loader_url + "/serving")
                self.fronts[r.name], urls[r.name] = start_front(
                    r.engine_url, r.root / "front.log", *gate
                )
        self.clients = Clients(self.replicas, self.run, urls)
        self.clients.start()

    def stop(self) -> None:
        """Stop every process this soak started."""
        if self.clients is not None:
            self.clients.stop()
        for r in self.replicas:
            r.resume_loader()
            r.stop()
        for front in self.fronts.values():
            front.stop()
        if self.trainer is not None:
            self.trainer.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.seaweed is not None:
            self.seaweed.stop()

    # --- publishing ------------------------------------------------------------------------

    def publish(self, step: int, *, kill_after: float | None = None) -> Published:
        """Publish `step`, asking again after a failure (the store down) until it lands; with
        `kill_after`, SIGKILL the trainer that many seconds into the first try and restart it."""
        assert self.trainer is not None
        sent = time.monotonic()
        attempts = 0
        deadline = sent + 600
        while True:
            attempts += 1
            self.trainer.ask(step)
            if kill_after is not None:
                time.sleep(kill_after)
                self.trainer.kill()
                self.run.fault_log.append(
                    f"trainer SIGKILLed {kill_after:.2f}s into publishing step {step}"
                )
                kill_after = None
                self.trainer.start()
                continue
            answer = self.trainer.answer(900)
            if answer.get("ok"):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step} not published after 600s: {answer}")
            time.sleep(1.0)
            self.tick()
        if answer.get("resumed"):
            self.run.fault_log.append(f"step {step} had landed before the kill: trainer resumed")
        published = Published(
            step=step,
            identity=str(answer["identity"]),
            kind=str(answer["kind"]),
            sha256=dict(answer["sha256"]),
            vllm_sha256=dict(answer["vllm_sha256"]),
            full_bytes=int(answer["full_bytes"]),
            shipped_bytes=int(answer["shipped_bytes"]),
            sent=sent,
            done=time.monotonic(),
            attempts=attempts,
            resumed=bool(answer.get("resumed")),
            landed=float(answer["landed"]) if answer.get("landed") is not None else None,
        )
        self.run.published[step] = published
        return published

    # --- faults ----------------------------------------------------------------------------

    def begin(self, fault: Fault, step: int) -> None:
        """Start `fault` (those that act at publish time are handled by `publish_step`)."""
        r = None if fault.replica is None else self.replicas[fault.replica]
        if fault.kind == "loader_kill" and r is not None:
            r.kill_loader()
            self.run.fault_log.append(f"step {step}: {r.name} loader SIGKILLed")
        elif fault.kind == "engine_kill" and r is not None:
            r.kill_engine()
            self.run.fault_log.append(f"step {step}: {r.name} engine SIGKILLed")
        elif fault.kind == "seaweed_down":
            assert self.seaweed is not None
            self.seaweed_up.clear()
            self.seaweed.kill()
            self.outage = (step, time.monotonic())
            self.run.fault_log.append(
                f"step {step}: SeaweedFS stopped for {self.cfg.outage_seconds:g}s"
            )
        elif fault.kind in ("apiserver_restart", *LEADER_KINDS):
            self._begin_cluster(fault, step)
        elif fault.kind == "slow_bucket" and self.cluster is not None and self.slow is None:
            self.cluster.slow_delay = self.cfg.slow_delay
            self.slow = (step, time.monotonic(), self.cluster.slow_held())
            self.run.fault_log.append(
                f"step {step}: deployment slow's bucket holds each request "
                f"{self.cfg.slow_delay:g}s for {self.cfg.slow_seconds:g}s or more"
            )
        elif fault.kind == "volume_full" and r is not None and r.loader is not None:
            # Room for the log (the same process writes it) and nothing the size of a delta's
            # shard: 512 KiB let a tiny model's deltas (~190 KB per file) through untouched, and
            # the fault then hit nothing (the 200-step run: no status named it).
            limit = (r.root / "loader.log").stat().st_size + 64 * 1024
            _, hard = resource.prlimit(r.loader.pid, resource.RLIMIT_FSIZE)
            resource.prlimit(r.loader.pid, resource.RLIMIT_FSIZE, (limit, hard))
            self.limited[fault.replica or 0] = r.loader.pid
            self.run.fault_log.append(
                f"step {step}: {r.name} loader limited to {limit} bytes per file (EFBIG)"
            )

    def _begin_cluster(self, fault: Fault, step: int) -> None:
        assert self.cluster is not None
        log = self.run.fault_log
        if fault.kind == "apiserver_restart":
            if self.api_outage is not None:
                # Still down from an earlier stop (steps go fast while it is): one outage,
                # lasting from now its full length again.
                log.append(
                    f"step {step}: kube-apiserver still stopped (since step "
                    f"{self.api_outage[0]}): down {self.cfg.apiserver_outage_seconds:g}s more"
                )
                self.api_outage = (self.api_outage[0], time.monotonic())
                return
            self.cluster.stop_apiserver()
            self.api_outage = (step, time.monotonic())
            log.append(
                f"step {step}: kube-apiserver stopped for {self.cfg.apiserver_outage_seconds:g}s"
            )
            return
        # One leader fault at a time (each at most FREEZE_CAP), and the leader chosen while
        # the API server answers: during an outage the last holder seen may have stepped down
        # (a leader exits once it cannot renew), and the fault would hit a standby.
        while self.frozen is not None or self.killed is not None or self.api_outage is not None:
            time.sleep(0.5)
            self._tick_cluster()
        leader = self.cluster.leader()
        if leader is None or not leader.alive():
            log.append(f"step {step}: {fault.kind}: no operator process holds the Lease")
            return
        deposal = Deposal(fault.kind, step, leader.identity, time.time())
        self.cluster.record.deposals.append(deposal)
        if fault.kind == "leader_kill":
            leader.signal(signal.SIGKILL)
            self.operators_down.add(leader.identity)
            self.killed = deposal
            self.kill_ended = False
            log.append(f"step {step}: operator leader {leader.identity} SIGKILLed")
        elif fault.kind == "leader_cutoff":
            self.cluster.partitions[leader.identity].cut()
            self.frozen = deposal
            log.append(
                f"step {step}: operator leader {leader.identity} cut off from the API server"
            )
        else:
            leader.signal(signal.SIGSTOP)
            self.frozen = deposal
            log.append(f"step {step}: operator leader {leader.identity} SIGSTOPped")

    def _wake(self, why: str) -> None:
        """SIGCONT the frozen leader, or heal the cut-off one's partition."""
        assert self.cluster is not None and self.frozen is not None
        identity = self.frozen.identity
        self.frozen.woken_at = time.time()
        held = self.frozen.woken_at - self.frozen.at
        if self.frozen.how == "leader_cutoff":
            # What its process sent meanwhile (queued in the relay) reaches the API server now.
            self.cluster.partitions[identity].heal()
            self.run.fault_log.append(
                f"operator {identity} healed after {held:.1f}s cut off: {why}"
            )
        else:
            self.cluster.operators[identity].signal(signal.SIGCONT)
            self.run.fault_log.append(
                f"operator {identity} SIGCONTed after {held:.1f}s frozen: {why}"
            )
        self.frozen = None

    def holds(self, fault: Fault, step: int) -> bool:
        """Whether a full volume due to end stays full one more step: its loader has written
        nothing since it began (no head reached it: an API server outage and the operator's
        re-election hand none over for ~20 steps), so the fault would have hit nothing. Held
        for at most `FULL_HOLD` steps past its end."""
        if fault.kind != "volume_full" or step >= fault.start + fault.steps + FULL_HOLD:
            return False
        name = f"r{fault.replica}"
        named = any(
            s["step"] >= fault.start
            and s.get("replica") == name
            and any(w in status_words(s) for w in FULL_WORDS)
            for s in self.run.volume_full_statuses
        )
        if not named and step == fault.start + fault.steps:
            self.run.fault_log.append(
                f"step {step}: {name} volume kept full: its loader has written nothing yet"
            )
        return not named

    def start_engine(self, r: Replica) -> None:
        """Start `r`'s engine (from `weights/current`, as its container would), noting when."""
        self.run.engine_starts.setdefault(r.name, []).append(time.monotonic())
        r.start_engine()

    def tick(self) -> None:
        """Start the stopped store and API server again once their outages are over, wake a
        frozen leader once the standby leads. Called from the main thread only: the store dies
        with the thread that started it (PR_SET_PDEATHSIG)."""
        self._tick_cluster()
        if self.outage is None:
            return
        step, began = self.outage
        if time.monotonic() - began < self.cfg.outage_seconds:
            return
        assert self.seaweed is not None
        try:
            self.seaweed.restart()
        except RuntimeError as err:
            # Its ports taken for a moment (a client's ephemeral port): try again next tick.
            if time.monotonic() - began > self.cfg.outage_seconds + 300:
                raise
            self.run.fault_log.append(f"SeaweedFS did not start again ({err}); retrying")
            return
        self.outage = None
        self.seaweed_up.set()
        self.run.store_down.append((began + self.run.wall_offset, time.time()))
        self.run.fault_log.append(
            f"SeaweedFS back after {time.monotonic() - began:.1f}s (outage of step {step})"
        )

    def _tick_cluster(self) -> None:
        if self.cluster is None:
            return
        if self.api_outage is not None:
            step, began = self.api_outage
            if time.monotonic() - began >= self.cfg.apiserver_outage_seconds:
                took = self.cluster.start_apiserver()
                self.api_outage = None
                self.run.fault_log.append(
                    f"kube-apiserver back after {time.monotonic() - began:.1f}s (stopped at step "
                    f"{step}; {took:.1f}s to ready)"
                )
        if self.frozen is not None and self.api_outage is None:
            now = self.cluster.holder()
            if now and now != self.frozen.identity:
                self._wake(f"{now} holds the Lease")
            elif time.time() - self.frozen.at > FREEZE_CAP:
                self._wake(f"the standby did not take the Lease in {FREEZE_CAP:g}s")
        if self.slow is not None:
            step, began, held = self.slow
            # Held until the door has held requests too: a leader deposed meanwhile (or the
            # store down) reads no ledger, and a window that held nothing shows nothing.
            elapsed = time.monotonic() - began
            enough = self.cluster.slow_held() - held >= SLOW_MIN_HELD
            if elapsed >= self.cfg.slow_seconds and (
                enough or elapsed >= SLOW_CAP_FACTOR * self.cfg.slow_seconds
            ):
                self.cluster.slow_delay = 0.0
                self.slow = None
                took = time.monotonic() - began
                held = self.cluster.slow_held() - held
                self.cluster.record.slow_requests += held
                self.cluster.record.slow_windows.append((time.time() - took, time.time()))
                self.run.fault_log.append(
                    f"deployment slow's bucket answering again after {took:.1f}s (slow since "
                    f"step {step}; {held} requests held)"
                )
        if self.killed is not None and self.kill_ended and self.api_outage is None:
            now = self.cluster.holder()
            if now and now != self.killed.identity:
                self._restart_killed(f"{now} holds the Lease")
            elif time.time() - self.killed.at > FREEZE_CAP:
                self._restart_killed(f"the standby did not take the Lease in {FREEZE_CAP:g}s")

    def _restart_killed(self, why: str) -> None:
        """Start the killed leader's process again."""
        assert self.cluster is not None and self.killed is not None
        identity = self.killed.identity
        self.cluster.operators[identity].start()
        self.operators_down.discard(identity)
        self.run.fault_log.append(
            f"operator {identity} started again {time.time() - self.killed.at:.1f}s after "
            f"its kill: {why}"
        )
        self.killed = None

    def end(self, fault: Fault, step: int) -> None:
        """End `fault`: start what was killed, lift the limit."""
        r = None if fault.replica is None else self.replicas[fault.replica]
        if fault.kind == "loader_kill" and r is not None:
            if r.loader is None or r.loader.poll() is not None:
                r.start_loader()
                self.run.fault_log.append(f"step {step}: {r.name} loader started again")
        elif fault.kind == "engine_kill" and r is not None:
            if r.engine is None or r.engine.poll() is not None:
                self.start_engine(r)
                self.run.fault_log.append(f"step {step}: {r.name} engine started again")
        elif fault.kind == "leader_kill" and self.cluster is not None:
            # Started again once another replica leads (`tick`), as a frozen leader is woken.
            self.kill_ended = True
            self._tick_cluster()
        elif fault.kind in ("leader_freeze", "leader_cutoff"):
            # The frozen leader stays frozen past the fault's steps until the standby leads
            # (`tick` wakes it then, or after FREEZE_CAP): a step is shorter than a lease.
            self._tick_cluster()
        elif fault.kind == "volume_full" and fault.replica is not None:
            pid = self.limited.pop(fault.replica, None)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
                    resource.prlimit(pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))
                self.run.fault_log.append(f"step {step}: r{fault.replica} volume has room again")

    def publish_step(self, step: int, starting: list[Fault]) -> None:
        """Publish `step` under the faults that act on the publish itself."""
        kinds = {f.kind for f in starting}
        if "corrupt" in kinds:
            # Loaders held still, so that none reads the step before its object is corrupted.
            for r in self.replicas:
                r.pause_loader()
            try:
                self.publish(step)
                self.run.fault_log.append(f"step {step}: {self._corrupt(step)}")
            finally:
                for r in self.replicas:
                    r.resume_loader()
            self.run.fault_log.append(f"step {step}: {self._await_corruption_read(step)}")
        elif "trainer_kill" in kinds:
            self.publish(step, kill_after=self.rng.uniform(0.3, 2.0))
        else:
            self.publish(step)

    def _await_corruption_read(self, step: int, timeout: float = CORRUPT_READ_SECONDS) -> str:
        """Wait until a loader's status names the corrupted object of `step`: the next steps
        (and a leader fault they may start, which stops the head's handoff) come only after a
        loader read it; a CI run whose leader froze two steps later saw loaders skip the
        whole broken chain for the next full snapshot."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            for r in self.replicas:
                status = self._status(r)
                if status is not None and any(w in status_words(status) for w in CORRUPT_WORDS):
                    self.run.corrupt_statuses.append({"step": step, "replica": r.name, **status})
                    waited = time.monotonic() - began
                    return f"{r.name}'s status named the corrupted object after {waited:.1f}s"
            time.sleep(0.5)
            self.tick()
        return f"no loader status named the corrupted object within {timeout:g}s"

    def _corrupt(self, step: int) -> str:
        import obstore

        folder = f"{self.prefix}/{step_identity(step)}/"
        objects = [o for batch in obstore.list(self.store, prefix=folder) for o in batch]
        shards = [o for o in objects if str(o["path"]).endswith(".safetensors")]
        if not shards:
            raise AssertionError(f"no payload under {folder} to corrupt: {objects}")
        target = max(shards, key=lambda o: int(o["size"]))
        data = bytearray(bytes(obstore.get(self.store, target["path"]).bytes()))
        data[len(data) // 2] ^= 0xFF  # in the payload, past the safetensors header
        obstore.put(self.store, target["path"], bytes(data))
        return f"one byte of {target['path']} ({target['size']} bytes) flipped in the bucket"

    # --- measuring -------------------------------------------------------------------------

    def sample(self, step: int, active: list[Fault]) -> None:
        """Processes, volumes, staging, statuses and the bucket after publishing `step`."""
        s = Sample(step, time.monotonic())
        if self.cluster is not None:
            self.cluster.supervise(self.run.fault_log, step, self.operators_down)
            self.cluster.kubelet(self._probes())
            # Before the loaders' statuses: what the operator's status names was served by then.
            s.cluster = self.cluster.sample()
            for name, pid in self.cluster.processes().items():
                usage = proc_usage(pid)
                if usage is not None:
                    s.procs[name] = (pid, *usage)
        for r in self.replicas:
            # A booting vLLM (minutes on a loaded machine) is not sampled: its RSS and fds are
            # its imports', not a running engine's. A reference engine boots in seconds, and
            # its /health may miss 5 s mid-load on a loaded machine: every look counts.
            booting = r.name in self.run.vllm and not self._live(r)
            for what, pid in self._processes(r).items():
                if what != "loader" and booting:
                    continue
                usage = proc_usage(pid)
                if usage is not None:
                    s.procs[f"{r.name}/{what}"] = (pid, *usage)
            entries_bytes: dict[str, int] = {}
            s.volume[r.name] = folder_bytes(r.weights, entries_bytes)
            s.volume_entries[r.name] = entries_bytes
            s.early[r.name] = folder_bytes(r.weights / ".hotload" / "early")
            before = self._status(r)
            work = r.weights / ".hotload"
            entries = [
                f"{sub}/{p.name}"
                for sub in ("staging", "downloads")
                if (work / sub).is_dir()
                for p in (work / sub).iterdir()
            ]
            after = self._status(r)
            if before is not None:
                s.status[r.name] = before
            # A loader whose engine is down reads idle but waits on it with its next update
            # begun (the early fetch of the next full snapshot: one at most, `prefetch.py`),
            # as mid-update: not an idle look.
            if (
                before is not None
                and after is not None
                and before.get("state") == after.get("state") == "idle"
                and before.get("identity") == after.get("identity")
                and REASON_ENGINE_DOWN not in (before.get("reason"), after.get("reason"))
            ):
                s.staging_idle[r.name] = entries
            for f in active:
                if before is not None and f.kind == "corrupt":
                    self.run.corrupt_statuses.append({"step": step, "replica": r.name, **before})
                if before is not None and f.kind == "volume_full" and f.replica == int(r.name[1:]):
                    self.run.volume_full_statuses.append(
                        {"step": step, "replica": r.name, **before}
                    )
        if self.seaweed_up.is_set():
            with contextlib.suppress(Exception):
                self._bucket(s)
        self.run.samples.append(s)

    @staticmethod
    def _live(r: Replica) -> bool:
        """Whether `r`'s engine answers its liveness probe (`/health`)."""
        try:
            return http_json("GET", r.engine_url + "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def _probes(self) -> dict[str, str]:
        """Each pod's engine readiness probe URL (the kubelet's part)."""
        return {self.run.pods[r.name]: r.engine_url + r.ready_path for r in self.replicas}

    @staticmethod
    def _processes(r: Replica) -> dict[str, int]:
        """`r`'s running processes by role: its loader, its engine's (vLLM: API server and
        engine core and model worker)."""
        out = {}
        if r.loader is not None and r.loader.poll() is None:
            out["loader"] = r.loader.pid
        return {**out, **r.engine_processes()}

    @staticmethod
    def _status(r: Replica) -> dict[str, Any] | None:
        try:
            code, doc = http_json("GET", r.loader_url + "/status", timeout=10)
        except OSError:
            return None
        if code != 200 or not isinstance(doc, dict):
            return None
        keys = ("state", "identity", "target_identity", "reason", "last_error", "events")
        out = {k: doc.get(k) for k in keys}
        out["events"] = [
            f"{e.get('reason')}: {e.get('message')}" for e in (doc.get("events") or [])[-5:]
        ]
        return out

    def _bucket(self, s: Sample) -> None:
        import obstore

        objects = [o for batch in obstore.list(self.store, prefix=self.prefix + "/") for o in batch]
        s.bucket_objects = len(objects)
        s.bucket_bytes = sum(int(o["size"]) for o in objects)
        folders = {str(o["path"]).split("/")[1] for o in objects}
        s.bucket_folders = sorted(f for f in folders if f.startswith("step-"))

    def spot_check(self, step: int) -> None:
        """Compare one random replica's served weights with the trainer's record."""
        r = self.rng.choice(self.replicas)
        try:
            code, body = r.served_checksums(timeout=60)
        except OSError as err:
            self.run.spot_checks.append(SpotCheck(step, r.name, None, [], f"unreachable: {err}"))
            return
        if not isinstance(body, dict):
            error = f"HTTP {code}: {body[:200]}"
            self.run.spot_checks.append(SpotCheck(step, r.name, None, [], error))
            return
        if r.name in self.fronts:
            # Weights its front holds (an engine restarted on older ones, not yet patched
            # forward) answer no client: nothing to judge.
            with contextlib.suppress(OSError):
                gate, why = http_json("GET", r.loader_url + "/serving", timeout=10)
                if gate == 503 and isinstance(why, dict):
                    held = f"held by its serving gate: {str(why.get('reason'))[:200]}"
                    self.run.spot_checks.append(SpotCheck(step, r.name, None, [], held))
                    return
        self.run.spot_checks.append(self.compare(step, r.name, body))

    def compare(self, step: int, name: str, body: dict[str, Any]) -> SpotCheck:
        """A `SpotCheck` of an engine's checksums answer against the trainer's record."""
        ident = str(body.get("identity"))
        got = body.get("checksums") or {}
        record = next((p for p in self.run.published.values() if p.identity == ident), None)
        if record is None:
            return SpotCheck(step, name, ident, [], f"serves {ident!r}, which was never published")
        bad = sorted(k for k, v in self.run.expected(name, record).items() if got.get(k) != v)
        return SpotCheck(step, name, ident, bad)

    def idle_cpu(self) -> None:
        """% of a core each process used over `idle_seconds` with nothing to do."""
        assert self.seaweed is not None and self.seaweed.process is not None
        pids: dict[str, int] = {"seaweedfs": self.seaweed.process.pid}
        if self.trainer is not None and self.trainer.proc is not None:
            pids["trainer"] = self.trainer.proc.pid
        for r in self.replicas:
            pids.update({f"{r.name}/{what}": pid for what, pid in self._processes(r).items()})
        if self.cluster is not None:
            pids.update(self.cluster.processes())
        start = {k: cpu_ticks(p) for k, p in pids.items()}
        began = time.monotonic()
        time.sleep(self.cfg.idle_seconds)
        took = time.monotonic() - began
        hz = os.sysconf("SC_CLK_TCK")
        for k, p in pids.items():
            end, first = cpu_ticks(p), start[k]
            if end is not None and first is not None:
                self.run.idle_cpu[k] = round(100.0 * (end - first) / hz / took, 2)

    # --- the end ---------------------------------------------------------------------------

    def converge(self) -> None:
        """Wait for every replica to serve the head, then read what each engine holds."""
        head = self.run.published[max(self.run.published)]
        began = time.monotonic()
        try:
            for r in self.replicas:
                r.wait_serving(head.identity, self.cfg.converge_timeout)
            self.run.converged_seconds = time.monotonic() - began
        except AssertionError as err:
            self.run.converge_error = str(err)[:3000]
        if self.cluster is not None:
            # The kubelet's part goes on until the status shows the head, all Ready.
            deadline = time.monotonic() + self.cfg.converge_timeout
            began_status = time.monotonic()
            while time.monotonic() < deadline:
                self.cluster.kubelet(self._probes())
                self.cluster.wait_head(head.identity, 2.0)
                if self.cluster.record.final_error is None:
                    self.cluster.record.final_seconds = time.monotonic() - began_status
                    break
            with contextlib.suppress(Exception):
                self.cluster.events()
        for r in self.replicas:
            self.run.final_status[r.name] = self._status(r) or {}
            with contextlib.suppress(OSError):
                _code, body = r.served_checksums(timeout=60)
                if isinstance(body, dict):
                    self.run.final_checksums[r.name] = {
                        "identity": str(body.get("identity")),
                        **{f"sha:{k}": str(v) for k, v in (body.get("checksums") or {}).items()},
                    }


def retarget(faults: list[Fault], first_vllm: int, replicas: int) -> list[str]:
    """Move the schedule's first engine kill and first loader kill to the first vLLM replica
    (`first_vllm`; none when it is `replicas`), so that every run restarts a vLLM engine and its
    loader; not where a full volume on that replica overlaps the kill (the schedule keeps kills
    off a replica whose loader must write). Returns what was moved, for the results."""
    moved: list[str] = []
    if first_vllm >= replicas:
        return moved
    for kind in ("engine_kill", "loader_kill"):
        kill = min((f for f in faults if f.kind == kind), key=lambda f: f.start, default=None)
        if kill is None or kill.replica == first_vllm:
            continue
        clash = any(
            f.kind == "volume_full"
            and f.replica == first_vllm
            and kill.start < f.start + f.steps
            and f.start < kill.start + kill.steps + 3
            for f in faults
        )
        if clash:
            moved.append(f"{kill.label()}: left (a full volume on r{first_vllm} overlaps it)")
            continue
        was = kill.label()
        kill.replica = first_vllm
        moved.append(f"{was} -> r{first_vllm} (a vLLM replica)")
    return moved


def run_soak(cfg: SoakConfig) -> SoakRun:
    """Run the whole soak; every process it started is stopped before it returns."""
    began = time.monotonic()
    cfg.root.mkdir(parents=True, exist_ok=True)
    soak = Soak(cfg)
    rng = random.Random(cfg.seed + 2)
    try:
        soak.start()
        active: list[Fault] = []
        try:
            for step in range(1, cfg.steps):
                starting = [f for f in soak.run.faults if f.start == step]
                ending = [f for f in active if not f.active(step) and not soak.holds(f, step)]
                for f in ending:
                    soak.end(f, step)
                    active.remove(f)
                for f in starting:
                    soak.begin(f, step)
                    active.append(f)
                soak.publish_step(step, starting)
                soak.tick()
                soak.sample(step, active)
                if rng.random() < cfg.spot_check_rate:
                    soak.spot_check(step)
        except Exception as err:  # judged as a missed check, with what was measured so far
            soak.run.aborted = f"{type(err).__name__}: {err}"[:3000]
        for f in active:
            soak.end(f, cfg.steps)
        while (
            soak.outage is not None
            or soak.api_outage is not None
            or soak.frozen is not None
            or soak.killed is not None
            or soak.slow is not None
        ):
            time.sleep(0.5)
            soak.tick()
        soak.converge()
        time.sleep(2.0)  # the clients see the head too
        if soak.clients is not None:
            soak.clients.stop()  # idle means no requests either
        soak.idle_cpu()
    finally:
        soak.stop()
        soak.run.wall_seconds = time.monotonic() - began
    return soak.run
