"""A restarted engine never answers from weights older than its replica served (issue 36: in the
300-step soak a restarted vLLM answered from step 52 after step 73 until its loader patched it).

The loader keeps a floor (`hotload_sidecar.serving_gate`: the newest snapshot the engine served,
lowered only when the loader reaches a lower target on purpose) and answers `GET /serving`; the
engine front (`hotload front --gate-url`) reads it every second and, while it is closed, refuses
inference with 503 `engine_held` and the loader's reason.

- the floor's rules, as plain data;
- the front against a stub loader: closed, opened, and the last answer kept while the loader
  cannot be read;
- real processes: a loader (`python -m hotload_sidecar`) following sparse deltas, a reference
  engine restarted on the snapshot `current` names without booting forward (as vLLM boots), and
  `hotload front` before it: a client through the front never gets an older answer, while the
  engine itself, asked directly, does;
- the same restart while the loader is in a long full build (issue 48: its step looked at the
  engine only before the build, and the gate stayed open): held within a second or two.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from hotload.bucket import open_bucket
from hotload.errors import EngineUnavailableError
from hotload.ledger import Ledger
from hotload.router.front import EngineFront, FrontConfig, create_front_app
from hotload_sidecar.board import StatusBoard
from hotload_sidecar.config import Settings
from hotload_sidecar.engine_watch import WATCH_SECONDS, EngineWatch, restarted_on
from hotload_sidecar.engines import ServedSnapshot, make_adapter
from hotload_sidecar.loader import Loader
from hotload_sidecar.metrics import LoaderMetrics
from hotload_sidecar.serving_gate import ServingFloor
from hotload_sidecar.status import LocalReporter, ReplicaStatus
from hotload_sidecar.weights import WeightsFolder
from support.counting_proxy import CountingProxy, Fault
from support.fleet import PROMPT_IDS, Replica, Trainer, free_port, http_json, wait_for
from support.fronts import start_front
from support.seaweedfs import SeaweedFS
from support.tiny_llm import build_tiny_llm, sparse_steps

# --- the floor ----------------------------------------------------------------------------------


def test_without_a_floor_the_engine_answers_whatever_it_serves() -> None:
    floor = ServingFloor()
    assert floor.verdict(engine_live=False, served=None, sequence=None).serve
    floor.observe(None, None, "s9")  # nothing served yet: no floor
    assert floor.sequence is None
    assert floor.verdict(engine_live=True, served="s1", sequence=1).serve


def test_a_restarted_engine_is_held_until_it_serves_what_the_replica_served() -> None:
    floor = ServingFloor()
    floor.observe("s73", 73, "s136")
    assert (floor.identity, floor.sequence) == ("s73", 73)
    assert floor.verdict(engine_live=True, served="s73", sequence=73).serve

    floor.engine_down()
    down = floor.verdict(engine_live=False, served="s73", sequence=73)
    assert not down.serve and "s73" in down.reason and "went down" in down.reason
    # Back, but the loader has not asked it yet: the status still names what it served before.
    assert not floor.verdict(engine_live=True, served="s73", sequence=73).serve

    floor.observe("s52", 52, "s136")  # it booted the older snapshot `current` names
    floor.confirmed()
    assert floor.sequence == 73, "an older snapshot that is not the target lowers nothing"
    older = floor.verdict(engine_live=True, served="s52", sequence=52)
    assert not older.serve
    assert "s52 (sequence 52)" in older.reason and "s73 (sequence 73)" in older.reason

    floor.observe("s100", 100, "s136")  # patched forward past it
    assert floor.verdict(engine_live=True, served="s100", sequence=100).serve
    assert floor.sequence == 100
    unknown = floor.verdict(engine_live=True, served="booted", sequence=None)
    assert not unknown.serve and "booted" in unknown.reason


def test_the_floor_survives_a_loader_restart_on_its_volume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loader restarted (with its engine or not) knows the floor its previous run kept on the
    volume, so it holds an engine it has not confirmed yet: the `Loader` wires its board to
    the weights folder's `floor_path`. A floor file that cannot be read is ignored, said."""
    bucket = tmp_path / "bucket"
    settings = Settings(
        ledger_url=f"{bucket}/policy", weights_dir=tmp_path / "w", engine_url="http://x"
    )

    def loader() -> Loader:
        return Loader(
            settings,
            ledger=Ledger(open_bucket(str(bucket)), "policy"),
            adapter=make_adapter("reference", "http://127.0.0.1:9"),
            reporter=LocalReporter(),
        )

    first = loader()
    assert first.board.floor.sequence is None
    first.board.floor.observe("s72", 72, "s80")
    first.board.floor.observe("s73", 73, "s80")
    restarted = loader()
    assert (restarted.board.floor.identity, restarted.board.floor.sequence) == ("s73", 73)
    # Nothing confirmed yet (the status names nothing): held.
    verdict = restarted.board.may_serve()
    assert not verdict.serve and "s73 (sequence 73)" in verdict.reason
    # A pin to an older target, reached on purpose, is kept as the lower floor.
    restarted.board.floor.observe("s10", 10, "s10")
    assert loader().board.floor.sequence == 10
    other = Loader(
        settings,
        ledger=Ledger(open_bucket(str(bucket)), "another"),
        adapter=make_adapter("reference", "http://127.0.0.1:9"),
        reporter=LocalReporter(),
    )
    assert other.board.floor.sequence is None  # a volume reused for another ledger
    WeightsFolder(tmp_path / "w").floor_path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="hotload_sidecar.serving_gate"):
        assert loader().board.floor.sequence is None
    assert any("ignoring the serving floor" in r.getMessage() for r in caplog.records)


class _Engine:
    """What the engine watch asks of an adapter: whether a load of the loader's runs (`busy`)
    and what the engine serves; `during` runs inside the answer (the loader moving on)."""

    def __init__(self) -> None:
        self.busy = False
        self.serves: ServedSnapshot | EngineUnavailableError | None = None
        self.asked = 0
        self.during: Callable[[], None] | None = None

    async def current(self) -> ServedSnapshot | None:
        self.asked += 1
        if self.during is not None:
            self.during()
        if isinstance(self.serves, EngineUnavailableError):
            raise self.serves
        return self.serves


@pytest.mark.asyncio
async def test_the_engine_watch_judges_only_what_the_engine_said_of_itself(
    tmp_path: Path,
) -> None:
    """A look while a load of the loader's talks to the engine asks nothing; one during which
    the status moved is dropped; an engine that does not answer is down; and before the loader
    confirmed anything (a restarted loader with its floor), the gate judges the engine by what
    the last look saw: the floor's snapshot serves, an older one is held."""
    floor_path = tmp_path / "floor.json"
    ServingFloor(floor_path, ledger="policy").observe("s73", 73, "s73")
    board = StatusBoard(LocalReporter(), LoaderMetrics(), floor_path=floor_path, ledger="policy")
    engine = _Engine()
    sequences = {"s52": 52, "s73": 73}
    watch = EngineWatch(
        engine,  # type: ignore[arg-type]
        board,
        sequence_of=sequences.get,
        down=lambda why: asyncio.sleep(0),
    )
    assert not board.may_serve().serve  # nothing seen, nothing confirmed: held
    engine.serves = ServedSnapshot("s73", None)
    assert await watch.look() is None and board.observed == ("s73", 73)
    assert board.may_serve().serve  # it serves the floor
    engine.serves = ServedSnapshot("s52", None)
    assert await watch.look() is None  # nothing served yet: no restart to judge
    assert not board.may_serve().serve and "s52" in board.may_serve().reason
    await board.set(identity="s73", sequence=73, state="idle", target_identity="s80")
    assert "s52" in (await watch.look() or "")  # confirmed s73, now it names s52
    engine.busy, asked = True, engine.asked
    assert await watch.look() is None and engine.asked == asked  # the loader's own load
    engine.busy = False
    engine.during = lambda: setattr(board, "status", board.status.evolve(identity="s80"))
    assert await watch.look() is None  # the status moved during the look: dropped
    engine.during = None
    engine.serves = EngineUnavailableError("GET /hotload/v1/status failed", engine="x", url="u")
    assert "failed" in (await watch.look() or "")


_SERVING_2 = ReplicaStatus(identity="step-2", sequence=3, target_identity="step-3")


@pytest.mark.parametrize(
    ("served", "sequence", "status", "floor", "restarted"),
    [
        (None, None, _SERVING_2, 3, False),  # it cannot say: its liveness decides
        ("step-2", 3, _SERVING_2, 3, False),  # what the status names
        ("step-3", 4, _SERVING_2, 3, False),  # the target: the loader's own load landing
        ("step-4", 5, _SERVING_2, 3, False),  # newer still (a chained load under way)
        ("step-0", 1, _SERVING_2, 3, True),  # older: booted from an older `current`
        ("gone", None, _SERVING_2, 3, True),  # not in the ledger any more
        ("step-0", 1, _SERVING_2.evolve(target_identity="step-0"), 3, False),  # a pin, on purpose
        ("step-0", 1, ReplicaStatus(), None, False),  # nothing served yet: no floor
    ],
)
def test_an_engine_naming_older_weights_than_it_served_has_restarted(
    served: str | None,
    sequence: int | None,
    status: ReplicaStatus,
    floor: int | None,
    restarted: bool,
) -> None:
    answer = ServedSnapshot(served, None) if served is not None else None
    why = restarted_on(answer, sequence, status, floor)
    assert (why is not None) == restarted, why
    if why is not None:
        assert served is not None and served in why and "step-2" in why


def test_reaching_an_older_target_on_purpose_lowers_the_floor() -> None:
    floor = ServingFloor()
    floor.observe("s73", 73, "s73")
    floor.observe("s40", 40, "s40")  # pinned back to s40 (a rollback)
    assert (floor.identity, floor.sequence) == ("s40", 40)
    assert floor.verdict(engine_live=True, served="s40", sequence=40).serve


# --- the front against a stub loader --------------------------------------------------------------


class StubLoader:
    """`GET /serving` answering what the test sets."""

    def __init__(self) -> None:
        self.reason: str | None = None  # None: the engine may answer

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/serving", self.serving)
        return app

    async def serving(self, request: web.Request) -> web.Response:
        if self.reason is None:
            return web.json_response({"serve": True})
        return web.json_response({"serve": False, "reason": self.reason}, status=503)


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[tuple[StubLoader, TestServer, TestServer]]:
    """A stub loader, a stub engine answering every path with its path, and a front before it
    that reads the loader's gate every 50 ms."""

    async def engine(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    engine_app = web.Application()
    engine_app.router.add_route("*", "/{tail:.*}", engine)
    engine_server = TestServer(engine_app, host="127.0.0.1")
    await engine_server.start_server()
    loader = StubLoader()
    loader_server = TestServer(loader.app(), host="127.0.0.1")
    await loader_server.start_server()
    config = FrontConfig(gate_url=str(loader_server.make_url("/serving")), gate_period=0.05)
    front = TestServer(
        create_front_app(EngineFront(str(engine_server.make_url("")).rstrip("/"), config)),
        host="127.0.0.1",
    )
    await front.start_server()
    try:
        yield loader, loader_server, front
    finally:
        await front.close()
        await loader_server.close()
        await engine_server.close()


async def _ask(front: TestServer, method: str, path: str) -> tuple[int, Any, str | None]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, str(front.make_url(path)), json={}) as resp,
    ):
        return resp.status, await resp.json(), resp.headers.get("Retry-After")


async def _until(front: TestServer, status: int) -> None:
    for _ in range(200):  # 10 s of 50 ms gate reads
        if (await _ask(front, "POST", "/v1/completions"))[0] == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the front never answered {status}")


@pytest.mark.asyncio
async def test_the_front_holds_inference_while_the_loader_says_so(
    servers: tuple[StubLoader, TestServer, TestServer],
) -> None:
    loader, loader_server, front = servers
    assert await _ask(front, "POST", "/v1/completions") == (200, {"path": "/v1/completions"}, None)

    loader.reason = "the engine serves s52 (sequence 52), older than s73 (sequence 73)"
    await _until(front, 503)
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/ready")]:  # fmt: skip
        status, body, retry = await _ask(front, method, path)
        assert status == 503 and retry == "1", (path, status, body)
        assert body["error"]["type"] == "engine_held"
        assert loader.reason in body["error"]["message"]
    # Liveness and metrics pass: a held engine is not a dead one.
    for path in ("/health", "/metrics"):
        assert await _ask(front, "GET", path) == (200, {"path": path}, None)

    # The loader cannot be read (restarting): the last answer stays in force.
    await loader_server.close()
    await asyncio.sleep(0.3)
    assert (await _ask(front, "POST", "/v1/completions"))[0] == 503


@pytest.mark.asyncio
async def test_the_front_passes_again_once_the_loader_lets_it(
    servers: tuple[StubLoader, TestServer, TestServer],
) -> None:
    loader, _, front = servers
    loader.reason = "held"
    await _until(front, 503)
    loader.reason = None
    await _until(front, 200)
    assert await _ask(front, "POST", "/v1/completions") == (200, {"path": "/v1/completions"}, None)


# --- real processes -------------------------------------------------------------------------------


class ClientThread:
    """Asks the front for a completion all along, recording (status, model or error type)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[int, str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"prompt": PROMPT_IDS, "max_tokens": 1}
        while not self.stopping.wait(0.05):
            try:
                code, answer = http_json("POST", self.url + "/v1/completions", body, timeout=30)
            except OSError:
                continue
            if code == 200 and isinstance(answer, dict):
                self.seen.append((code, str(answer.get("model"))))
            elif isinstance(answer, dict) and isinstance(answer.get("error"), dict):
                self.seen.append((code, str(answer["error"].get("type"))))

    def stop(self) -> list[tuple[int, str]]:
        self.stopping.set()
        self.thread.join(60)
        return self.seen


def _direct_model(r: Replica) -> str | None:
    """The model the engine's own port answers from, None while it cannot answer."""
    code, answer = http_json(
        "POST", r.engine_url + "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1}
    )
    return str(answer["model"]) if code == 200 and isinstance(answer, dict) else None


def test_a_client_of_the_front_never_sees_a_restarted_engine_go_back(
    tmp_path: Path, env: dict[str, str], replicas: list[Replica]
) -> None:
    base = build_tiny_llm(tmp_path / "m", 0).snapshots[0]
    fulls, _ = sparse_steps(base, tmp_path / "steps", 2, fraction=0.01, seed=4)
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(Ledger(open_bucket(bucket), "policy"), fulls, tmp_path / "t", full_every=100)
    trainer.publish(0)
    # Booted from the snapshot `current` names, not through the link: as vLLM boots, it serves
    # that snapshot until the loader patches it (the reference engine would patch itself).
    r = Replica(
        "r0", tmp_path / "r0", f"{bucket}/policy", env, admin_port=free_port(), boot_forward=False
    )
    replicas.append(r)
    r.start()
    r.wait_serving(Trainer.identity(0), timeout=180)
    front, front_url = start_front(
        r.engine_url, tmp_path / "front.log", "--gate-url", r.loader_url + "/serving"
    )
    try:
        for step in (1, 2):
            trainer.publish(step)
        head = Trainer.identity(2)
        r.wait_serving(head, timeout=120)
        code, gate = http_json("GET", r.loader_url + "/serving")
        assert code == 200 and gate["floor"] == trainer.published[2].sequence, gate
        assert (r.weights / "current").resolve().name == Trainer.identity(0), "sparse: no fold"
        client = ClientThread(front_url)
        wait_for("an answer through the front", lambda: client.seen, 60)

        r.kill_engine()
        wait_for(
            "the loader to hold the dead engine",
            lambda: http_json("GET", r.loader_url + "/serving")[0] == 503,
            60,
        )
        wait_for(
            "the front to hold inference",
            lambda: (
                http_json("POST", front_url + "/v1/completions", {"prompt": PROMPT_IDS})[0] == 503
            ),
            30,
        )
        r.pause_loader()  # the engine comes back while its loader cannot patch it yet
        try:
            r.start_engine()
            old = f"tiny@{Trainer.identity(0)}"
            wait_for(
                f"the restarted engine answering from {old}", lambda: _direct_model(r) == old, 180
            )
            code, held = http_json("POST", front_url + "/v1/completions", {"prompt": PROMPT_IDS})
            assert code == 503 and held["error"]["type"] == "engine_held", held
            assert head in held["error"]["message"], held
            assert http_json("GET", front_url + "/health")[0] == 200
        finally:
            r.resume_loader()
        r.wait_serving(head, timeout=120)
        wait_for(
            f"the front answering from {head} again",
            lambda: any(m == f"tiny@{head}" for _, m in client.seen[-3:]),
            60,
        )
        seen = client.stop()
    finally:
        front.stop()
    answers = [m for code, m in seen if code == 200]
    assert answers and set(answers) == {f"tiny@{head}"}, sorted(set(answers))
    assert {m for code, m in seen if code != 200} <= {"engine_held", "engine_unavailable"}
    assert any(m == "engine_held" for _, m in seen), "the client never met the held engine"


def test_an_engine_restarted_during_a_full_build_is_held_at_once(
    tmp_path: Path, s3_env: SeaweedFS, env: dict[str, str], replicas: list[Replica]
) -> None:
    """Sparse steps 1 and 2 patched the engine (`current` still names step 0), then step 3 is a
    full snapshot whose files the origin's door holds: the loader is in its full build when the
    engine dies and boots again from step 0. The gate closes within a look or two of the
    engine watch, while the build is still held; released, the build lands and the gate opens
    on step 3."""
    base = build_tiny_llm(tmp_path / "m", 0).snapshots[0]
    fulls, _ = sparse_steps(base, tmp_path / "steps", 3, fraction=0.01, seed=5)
    url = s3_env.url(f"t-{uuid.uuid4().hex[:12]}")
    trainer = Trainer(Ledger(open_bucket(url), "policy"), fulls, tmp_path / "t", full_every=3)
    trainer.publish(0)
    release, building = threading.Event(), threading.Event()
    full_files = f"{Trainer.identity(3)}/"

    def hold(method: str, key: str) -> Fault | None:
        if method != "GET" or full_files not in key:
            return None
        building.set()
        return Fault(release=release)

    with CountingProxy(s3_env.endpoint) as door:
        door.fault = hold
        r = Replica(
            "r0",
            tmp_path / "r0",
            f"{url}/policy",
            {**env, "AWS_ENDPOINT_URL": door.endpoint},
            admin_port=free_port(),
            boot_forward=False,
        )
        replicas.append(r)
        r.start()
        r.wait_serving(Trainer.identity(0), timeout=180)
        for step in (1, 2):
            trainer.publish(step)
        r.wait_serving(Trainer.identity(2), timeout=120)
        assert (r.weights / "current").resolve().name == Trainer.identity(0), "sparse: no fold"
        assert http_json("GET", r.loader_url + "/serving")[0] == 200
        trainer.publish(3)  # a full snapshot: the loader builds it, its files held at the door
        wait_for("the door holding step 3's files", building.is_set, 60)

        def building_step_3() -> bool:
            doc = r.status()
            return doc["target_identity"] == Trainer.identity(3) and doc["state"] != "idle"

        wait_for("the loader in its full build of step 3", building_step_3, 60)
        try:
            r.kill_engine()
            killed = time.monotonic()
            wait_for(
                "the gate holding the dead engine",
                lambda: http_json("GET", r.loader_url + "/serving")[0] == 503,
                60,
            )
            assert time.monotonic() - killed <= 3 * WATCH_SECONDS + 2, "held, but late"
            r.start_engine()
            old = f"tiny@{Trainer.identity(0)}"
            wait_for(f"the engine answering from {old}", lambda: _direct_model(r) == old, 180)
            code, held = http_json("GET", r.loader_url + "/serving")
            assert code == 503 and Trainer.identity(2) in held["reason"], held
            assert r.status()["state"] != "idle"  # still in the full build
        finally:
            release.set()
        r.wait_serving(Trainer.identity(3), timeout=120)
        wait_for(
            "the gate open on step 3",
            lambda: http_json("GET", r.loader_url + "/serving")[0] == 200,
            30,
        )
