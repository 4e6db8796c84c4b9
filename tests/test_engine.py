"""The reference engine for real: a tiny Llama served over HTTP while snapshots are swapped.

Every test starts a real engine (transformers model on CPU, aiohttp server on loopback) and
talks to it with an aiohttp client. The snapshots come from `support.tiny_llm`: a random tiny
Llama and perturbed copies that generate visibly different tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from support.engines import PROMPTS, Result, complete, engine_of, load, serve
from support.fleet import free_port
from support.paths import REPO
from support.tiny_llm import TinyLLM, broken_snapshot, build_tiny_llm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Base snapshot s0 and perturbed snapshots s1..s3 of one tiny Llama."""
    return build_tiny_llm(tmp_path_factory.mktemp("tiny-llm"), 3)


# --- the model itself --------------------------------------------------------------------------


def test_exact_numerics_match_transformers_and_do_not_depend_on_batching(tiny: TinyLLM) -> None:
    """Exact numerics agree with transformers' forward, and are bit-identical alone, batched
    and with a cached prefix."""
    import torch
    from transformers import AutoModelForCausalLM

    from hotload.engine.batch import BatchKV
    from hotload.engine.model import ModelRunner

    runner, _ = ModelRunner.load(tiny.snapshots[0])
    assert runner.info.numerics == "exact"
    reference = AutoModelForCausalLM.from_pretrained(tiny.snapshots[0]).eval()
    prompt = [101, 2054, 2003, 1996, 3007, 1997, 2605, 102]
    logits, _ = runner.prefill(prompt)
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(logits, expected, atol=1e-5)

    def alone(p: list[int], n: int) -> list[torch.Tensor]:
        lg, kv = runner.prefill(p)
        batch, out = BatchKV(), [lg]
        batch.add(kv)
        for _ in range(n - 1):
            out.append(runner.decode(batch, [int(out[-1].argmax())])[0])
        return out

    prompts = [prompt[:3], prompt, prompt[2:6], [101, 7592]]
    singles = [alone(p, 6) for p in prompts]
    batch, rows = BatchKV(), []
    for p in prompts:
        lg, kv = runner.prefill(p)
        batch.add(kv)
        rows.append([lg])
    for _ in range(5):
        step = runner.decode(batch, [int(r[-1].argmax()) for r in rows])
        for i, r in enumerate(rows):
            r.append(step[i])
    if runner.info.batch_invariant:
        for single, batched in zip(singles, rows, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(single, batched, strict=True))
        # A prefix computed earlier (prefill + decode steps) gives the same bits as a full prefill.
        generated = [int(t.argmax()) for t in singles[1][:-1]]
        full, _ = runner.prefill(prompt + generated)
        _, kv = runner.prefill(prompt)
        cached, _ = runner.prefill(prompt + generated, kv, len(prompt))
        assert torch.equal(full, cached)


# --- the OpenAI surface --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_openai_endpoints_name_the_snapshot(tiny: TinyLLM) -> None:
    async with serve(tiny.snapshots[0], "s0") as client:
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny@s0"
        assert models["data"][0]["root"] == "tiny"

        r = await complete(client, PROMPTS[0], 12)
        assert r.status == 200
        assert r.body["model"] == "tiny@s0"
        assert r.body["hotload"]["identity_start"] == r.body["hotload"]["identity_end"] == "s0"
        assert r.body["usage"]["completion_tokens"] == len(r.tokens) == 12
        assert r.headers["x-hotload-snapshot"] == "s0"
        again = await complete(client, PROMPTS[0], 12, model="tiny@s0")
        assert again.tokens == r.tokens  # greedy is deterministic

        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
        )
        body = await chat.json()
        assert chat.status == 200 and body["object"] == "chat.completion"
        assert body["model"] == "tiny@s0" and body["usage"]["completion_tokens"] == 5
        assert isinstance(body["choices"][0]["message"]["content"], str)

        for bad, param in [
            ({"prompt": "x", "n": 2}, "n"),
            ({"prompt": "x", "temperature": 9}, "temperature"),
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"prompt": "x", "model": "other"}, "model"),
            ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ]:
            resp = await client.post("/v1/completions", json=bad)
            err = (await resp.json())["error"]
            assert resp.status in (400, 404) and err["param"] == param, (bad, err)
        resp = await client.post("/v1/completions", data=b"{not json")
        assert resp.status == 400


@pytest.mark.asyncio
async def test_streams_arrive_incrementally_and_name_the_snapshot(tiny: TinyLLM) -> None:
    async with serve(tiny.snapshots[0], "s0") as client:
        whole = await complete(client, PROMPTS[1], 40)
        streamed = await complete(client, PROMPTS[1], 40, stream=True)
        assert streamed.status == 200
        assert streamed.headers["Content-Type"].startswith("text/event-stream")
        assert len(streamed.chunks) >= 40
        assert all(c["model"] == "tiny@s0" for c in streamed.chunks)
        assert streamed.tokens == whole.tokens and streamed.text == whole.text
        # Chunks were produced as tokens were, not all at the end.
        assert streamed.times[-1] - streamed.times[0] > 0.02
        assert streamed.chunks[-1]["choices"][0]["finish_reason"] == "length"

        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True},
        )
        events = [line async for line in resp.content if line.startswith(b"data: ")]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert events[-1].strip() == b"data: [DONE]"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(
            c["object"] == "chat.completion.chunk" and c["model"] == "tiny@s0" for c in chunks
        )
        assert chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.asyncio
async def test_batched_requests_equal_requests_run_alone(tiny: TinyLLM) -> None:
    async with serve(tiny.snapshots[0], "s0", max_batch=8) as client:
        alone = [await complete(client, p, 20) for p in PROMPTS]
        together = await asyncio.gather(*(complete(client, p, 20) for p in PROMPTS))
        streamed = await asyncio.gather(*(complete(client, p, 20, stream=True) for p in PROMPTS))
        assert engine_of(client).scheduler.steps > 0
        if engine_of(client).runner.info.batch_invariant:
            assert [r.tokens for r in together] == [r.tokens for r in alone]
            assert [r.tokens for r in streamed] == [r.tokens for r in alone]


@pytest.mark.asyncio
async def test_a_client_that_goes_away_stops_its_generation(tiny: TinyLLM) -> None:
    async with serve(tiny.snapshots[0], "s0") as client:
        scheduler = engine_of(client).scheduler
        for stream in (False, True):
            steps_before = scheduler.steps
            body = {"prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "stream": stream}
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            while scheduler.running == 0:
                await asyncio.sleep(0.005)
            if stream:
                resp = await request
                await resp.content.readline()  # the stream has started
                resp.close()  # drop the connection mid-generation
            else:
                request.cancel()  # the client gives up waiting: aiohttp closes the connection
                with contextlib.suppress(asyncio.CancelledError):
                    await request
            deadline = time.monotonic() + 20
            while scheduler.running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert scheduler.running == 0
            assert scheduler.steps - steps_before < 479  # stopped well before its 480 tokens


# --- hot loads -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_async_swaps_under_load_fail_nothing(tiny: TinyLLM) -> None:
    """Concurrent clients, three ASYNC swaps (one per cache policy): every request succeeds,
    some span a swap, and streamed chunks switch snapshot mid-stream, never backwards."""
    order = {name: i for i, name in enumerate(tiny.identities)}
    results: list[Result] = []
    stop = asyncio.Event()

    async def client_loop(client: Any, k: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = PROMPTS[(k + i) % len(PROMPTS)]
            results.append(await complete(client, prompt, 24, stream=(i + k) % 2 == 0))
            i += 1

    async def finished(count: int) -> None:
        # Paced by requests served, not by seconds: on a busy machine a fixed pause may see
        # none finish between two swaps.
        target = len(results) + count
        deadline = time.monotonic() + 120
        while len(results) < target:
            assert time.monotonic() < deadline, f"{len(results)} requests served, not {target}"
            await asyncio.sleep(0.01)

    async with serve(tiny.snapshots[0], "s0", max_batch=4) as client:
        clients = [asyncio.create_task(client_loop(client, k)) for k in range(6)]
        loads = []
        for seq, policy in [(1, "all"), (2, "none"), (3, "new_session")]:
            await finished(4)
            loads.append(
                await load(client, tiny.snapshots[seq], f"s{seq}", seq, cache_policy=policy)
            )
        await finished(4)
        stop.set()
        await asyncio.gather(*clients)

        for status, body in loads:
            assert status == 200, body
            assert body["load_seconds"] >= body["pause_seconds"] >= 0
        assert [b["identity"] for _, b in loads] == ["s1", "s2", "s3"]
        assert all(r.status == 200 for r in results), [r.body for r in results if r.status != 200]
        assert len(results) >= 12
        spanning = [r for r in results if r.hotload["identity_start"] != r.hotload["identity_end"]]
        assert spanning, "no request was in flight during a swap"
        for r in results:
            h = r.hotload
            assert order[h["identity_start"]] <= order[h["identity_end"]]
            if r.chunks:
                seen = [c["model"].split("@")[1] for c in r.chunks]
                assert seen == sorted(seen, key=order.__getitem__)  # never goes back
                assert seen[-1] == h["identity_end"] and seen[0] == h["identity_start"]
            else:
                assert r.body["model"] == f"tiny@{h['identity_end']}"

        status = await (await client.get("/hotload/v1/status")).json()
        assert status["identity"] == "s3" and status["sequence"] == 3
        assert status["loads"] == 3 and status["loading"] is False and status["last_error"] is None
        metrics = await (await client.get("/metrics")).text()
        assert "hotload_engine_swap_pause_seconds_count 3.0" in metrics
        assert "hotload_engine_load_seconds_count 3.0" in metrics
        assert 'hotload_engine_served_snapshot_info{identity="s3"} 1.0' in metrics
        assert 'identity="s0"' not in metrics
        assert "hotload_engine_served_sequence 3.0" in metrics
        assert 'hotload_engine_requests_total{code="200",endpoint="/v1/completions"}' in metrics
        assert 'hotload_engine_tokens_total{kind="completion"}' in metrics


@pytest.mark.asyncio
async def test_outputs_after_a_swap_equal_a_fresh_engine(tiny: TinyLLM) -> None:
    """Requests after a swap, and the part of a request generated after it, equal what an
    engine started on those weights produces."""
    prompt_ids = [101, 1996, 7570, 2001, 2019, 2214, 102]
    async with serve(tiny.snapshots[0], "s0") as swapped:
        before = [await complete(swapped, p, 16) for p in PROMPTS[:3]]
        # A long streamed request; swap to s1 (cache policy all) once a few tokens are out.
        resp = await swapped.post(
            "/v1/completions",
            json={
                "prompt": prompt_ids,
                "max_tokens": 150,
                "stream": True,
                "return_token_ids": True,
            },
        )
        chunks: list[dict[str, Any]] = []
        swap: asyncio.Task[Any] | None = None
        async for raw in resp.content:
            if not raw.startswith(b"data: ") or raw.strip() == b"data: [DONE]":
                continue
            chunks.append(json.loads(raw[6:]))
            if len(chunks) == 5:
                swap = asyncio.create_task(load(swapped, tiny.snapshots[1], "s1", 1))
        assert swap is not None
        assert (await swap)[0] == 200
        after = [await complete(swapped, p, 16) for p in PROMPTS[:3]]
        models = [c["model"] for c in chunks if c["choices"][0].get("token_ids")]
        tokens = [
            c["choices"][0]["token_ids"][0] for c in chunks if c["choices"][0].get("token_ids")
        ]
        switch = models.index("tiny@s1")
        assert 0 < switch < len(models) and set(models[switch:]) == {"tiny@s1"}
        assert (await load(swapped, tiny.snapshots[0], "s0-again", 2))[0] == 200
        back = [await complete(swapped, p, 16) for p in PROMPTS[:3]]

    async with serve(tiny.snapshots[1], "s1") as fresh:
        expected = [await complete(fresh, p, 16) for p in PROMPTS[:3]]
        # The swapped request resumed on s1 with its KV recomputed: its tokens after the
        # switch are s1's greedy continuation of the prompt plus the tokens before it.
        tail = await complete(fresh, prompt_ids + tokens[:switch], len(tokens) - switch)

    assert [r.tokens for r in after] == [r.tokens for r in expected]
    assert [r.tokens for r in after] != [r.tokens for r in before]
    assert [r.tokens for r in back] == [r.tokens for r in before]  # reloading s0 restores it
    assert tail.tokens == tokens[switch:]


@pytest.mark.asyncio
async def test_sync_swap_refuses_with_425_then_serves(tiny: TinyLLM) -> None:
    """SYNC: running generations finish on the old weights, new requests get 425 until the
    swap is done, then succeed on the new weights."""
    async with serve(tiny.snapshots[0], "s0", max_batch=8) as client:
        long_runs = [asyncio.create_task(complete(client, p, 90, stream=True)) for p in PROMPTS[:4]]
        while engine_of(client).scheduler.running < 4:
            await asyncio.sleep(0.005)
        swap = asyncio.create_task(
            load(client, tiny.snapshots[1], "s1", 1, mode="sync", cache_policy="none")
        )
        seen: list[str] = []  # what each probe got: "s0", "425" or "s1"
        ready_codes = set()
        while not seen or seen[-1] != "s1":
            r = await complete(client, PROMPTS[5], 4)
            if r.status == 425:
                assert r.headers.get("Retry-After")
                assert r.body["error"]["type"] == "swap_in_progress"
                seen.append("425")
                ready_codes.add((await client.get("/ready")).status)
            else:
                assert r.status == 200, r.body
                seen.append(r.hotload["identity_start"])
            await asyncio.sleep(0.01)
        status, body = await swap
        assert status == 200 and body["mode"] == "sync"
        # Old weights while staging, then only 425s, then success on the new weights.
        first_refusal = seen.index("425")
        assert set(seen[:first_refusal]) <= {"s0"}
        assert set(seen[first_refusal:-1]) == {"425"} and seen[-1] == "s1"
        assert 503 in ready_codes
        for run in await asyncio.gather(*long_runs):
            assert run.status == 200 and len(run.tokens) == 90
            assert {c["model"] for c in run.chunks} == {"tiny@s0"}
            assert run.hotload["identity_end"] == "s0"
        # The pause covers the drain of the running generations.
        assert body["pause_seconds"] > 0
        after = await complete(client, PROMPTS[5], 4)
        assert after.status == 200 and after.body["model"] == "tiny@s1"
        assert (await client.get("/ready")).status == 200


@pytest.mark.asyncio
async def test_unmet_version_constraints_get_a_retryable_409(tiny: TinyLLM) -> None:
    async with serve(tiny.snapshots[0], "s0", sequence=4) as client:
        cases: list[tuple[dict[str, Any], dict[str, str]]] = [
            ({"min_snapshot_sequence": 5}, {}),
            ({}, {"x-hotload-min-sequence": "5"}),
            ({"snapshot_identity": "s1"}, {}),
            ({}, {"x-hotload-snapshot": "s1"}),
            ({"model": "tiny@s1"}, {}),
        ]
        for extra, headers in cases:
            r = await complete(client, PROMPTS[0], 4, headers=headers, **extra)
            assert r.status == 409, (extra, headers, r.body)
            err = r.body["error"]
            assert err["type"] == "snapshot_unavailable"
            assert err["served_identity"] == "s0" and err["served_sequence"] == 4
            assert "serves s0 (sequence 4)" in err["message"]
            assert r.headers["Retry-After"] == "1"
        ok = await complete(client, PROMPTS[0], 4, min_snapshot_sequence=4, snapshot_identity="s0")
        assert ok.status == 200
        streamed = await complete(
            client, PROMPTS[0], 4, stream=True, headers={"x-hotload-min-sequence": "9"}
        )
        assert streamed.status == 409  # refused before the stream starts
        conflict = await complete(client, PROMPTS[0], 4, snapshot_identity="s0", model="tiny@s1")
        assert conflict.status == 400

        assert (await load(client, tiny.snapshots[1], "s1", 5))[0] == 200
        r = await complete(client, PROMPTS[0], 4, headers={"x-hotload-min-sequence": "5"})
        assert r.status == 200 and r.body["model"] == "tiny@s1"
        metrics = await (await client.get("/metrics")).text()
        assert 'hotload_engine_requests_total{code="409",endpoint="/v1/completions"} 6.0' in metrics


@pytest.mark.asyncio
async def test_a_queued_request_whose_snapshot_was_swapped_away_gets_409(tiny: TinyLLM) -> None:
    """Constraints are checked again when a queued request is admitted: an ASYNC swap while it
    waited answers 409 (before any byte of the response), never tokens from other weights."""
    async with serve(tiny.snapshots[0], "s0", max_batch=1) as client:
        scheduler = engine_of(client).scheduler
        long_run = asyncio.create_task(complete(client, PROMPTS[0], 200, stream=True))
        while scheduler.running < 1:
            await asyncio.sleep(0.005)
        pinned = asyncio.create_task(
            complete(client, PROMPTS[1], 4, stream=True, snapshot_identity="s0")
        )
        while scheduler.queued < 1:
            await asyncio.sleep(0.005)
        assert (await load(client, tiny.snapshots[1], "s1", 1))[0] == 200
        refused = await pinned
        assert refused.status == 409
        assert refused.body["error"]["served_identity"] == "s1"
        spanning = await long_run
        assert spanning.status == 200
        assert (spanning.hotload["identity_start"], spanning.hotload["identity_end"]) == (
            "s0",
            "s1",
        )


@pytest.mark.asyncio
async def test_fast_numerics_in_bfloat16_serve_and_swap(tiny: TinyLLM) -> None:
    """The SDPA (`fast`) path with left-padding masks, computing in bf16 from fp32 snapshots."""
    async with serve(tiny.snapshots[0], "s0", numerics="fast", dtype="bfloat16") as client:
        together = await asyncio.gather(*(complete(client, p, 12) for p in PROMPTS))
        assert all(r.status == 200 and len(r.tokens) == 12 for r in together)
        status = await (await client.get("/hotload/v1/status")).json()
        assert (status["numerics"], status["dtype"]) == ("fast", "bfloat16")
        assert (await load(client, tiny.snapshots[1], "s1", 1))[0] == 200
        after = [await complete(client, p, 12) for p in PROMPTS[:3]]
    async with serve(tiny.snapshots[1], "s1", numerics="fast", dtype="bfloat16") as fresh:
        expected = [await complete(fresh, p, 12) for p in PROMPTS[:3]]
    assert [r.tokens for r in after] == [r.tokens for r in expected]


@pytest.mark.asyncio
async def test_failed_loads_keep_the_old_weights_and_say_why(tiny: TinyLLM, tmp_path: Path) -> None:
    from hotload.arc import encode

    broken = {
        defect: broken_snapshot(tiny.snapshots[1], tmp_path / defect, defect)
        for defect in ("missing_shard", "wrong_shape", "bad_checksum", "missing_tensor", "config")
    }
    delta = tmp_path / "delta"
    encode(tiny.snapshots[0], tiny.snapshots[1], delta, parent_identity="s0", threads=1)
    async with serve(tiny.snapshots[0], "s0") as client:
        baseline = await complete(client, PROMPTS[3], 12)
        expect = {
            "missing_shard": ("snapshot_invalid", "missing"),
            "wrong_shape": ("weights_mismatch", "model.layers.0.self_attn.q_proj.weight"),
            "bad_checksum": ("checksum_mismatch", "model.layers.1.mlp.up_proj.weight"),
            "missing_tensor": ("weights_mismatch", "model.norm.weight"),
            "config": ("snapshot_invalid", "hidden_act"),
        }
        for defect, path in broken.items():
            status, body = await load(client, path, f"bad-{defect}".replace("_", "-"), 1)
            want_type, want_text = expect[defect]
            assert status == 422, (defect, body)
            assert body["error"]["type"] == want_type, (defect, body)
            assert want_text in body["error"]["message"], (defect, body)
        for path, kind in [(delta, "incremental"), (tmp_path / "nowhere", "does not exist")]:
            status, body = await load(client, path, "x1", 1)
            assert status == 422 and kind in body["error"]["message"], body
        for bad_body in [
            {"path": str(tiny.snapshots[1]), "sequence": 1},
            {"path": str(tiny.snapshots[1]), "identity": "a/b", "sequence": 1},
            {"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": 1, "mode": "later"},
            {"path": str(tiny.snapshots[1]), "identity": "s1", "sequence": -1},
            {"identity": "s1", "sequence": 1},
        ]:
            resp = await client.post("/hotload/v1/load", json=bad_body)
            assert resp.status == 400, bad_body
            assert (await resp.json())["error"]["type"] == "invalid_request_error"

        status_doc = await (await client.get("/hotload/v1/status")).json()
        assert status_doc["identity"] == "s0" and status_doc["loads"] == 0
        assert "nowhere" in status_doc["last_error"]
        assert "does not exist" in status_doc["last_error"]
        after = await complete(client, PROMPTS[3], 12)
        assert after.body["model"] == "tiny@s0" and after.tokens == baseline.tokens

        # Two loads at once: the second is refused while the first runs.
        (s1, b1), (s2, b2) = await asyncio.gather(
            load(client, tiny.snapshots[1], "s1", 1), load(client, tiny.snapshots[2], "s2", 2)
        )
        assert sorted([s1, s2]) == [200, 409]
        assert (b2 if s2 == 409 else b1)["error"]["type"] == "load_in_progress"
        metrics = await (await client.get("/metrics")).text()
        assert 'hotload_engine_load_failures_total{type="weights_mismatch"} 2.0' in metrics


@pytest.mark.asyncio
async def test_session_prefix_cache_hits_and_follows_the_cache_policy(tiny: TinyLLM) -> None:
    async with serve(tiny.snapshots[0], "s0") as client:

        async def turn(session: str, prompt: list[int], header: str = "x-multi-turn-session-id"):
            return await complete(client, prompt, 8, headers={header: session})

        first_prompt = [101, 2023, 2003, 1037, 3231, 102]
        t1 = await turn("a", first_prompt)
        assert t1.body["hotload"]["prefix_cached_tokens"] == 0
        second_prompt = first_prompt + t1.tokens + [2129, 2055, 102]
        t2 = await turn("a", second_prompt)
        # Everything the first turn fed through the model is reused (its last token was not fed).
        assert t2.body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first_prompt) + 7
        plain = await complete(client, second_prompt, 8)  # no session: no cache
        assert plain.body["hotload"]["prefix_cached_tokens"] == 0
        if engine_of(client).runner.info.batch_invariant:
            assert t2.tokens == plain.tokens  # the cache changes speed, never outputs
        via_affinity = await turn("b", first_prompt, "x-session-affinity")
        again = await turn("b", first_prompt + via_affinity.tokens, "x-session-affinity")
        assert again.body["hotload"]["prefix_cached_tokens"] > 0

        # none: keep every entry (stale KV accepted by the policy).
        assert (await load(client, tiny.snapshots[1], "s1", 1, cache_policy="none"))[0] == 200
        t3 = await turn("a", second_prompt + t2.tokens)
        assert t3.body["hotload"]["prefix_cached_tokens"] > 0
        # all: drop every entry; the next turn starts clean.
        assert (await load(client, tiny.snapshots[2], "s2", 2, cache_policy="all"))[0] == 200
        t4 = await turn("a", second_prompt + t2.tokens + t3.tokens)
        assert t4.body["hotload"]["prefix_cached_tokens"] == 0
        # new_session: a session running before the swap keeps its cache; a new one has none.
        assert (await load(client, tiny.snapshots[3], "s3", 3, cache_policy="new_session"))[
            0
        ] == 200
        t5 = await turn("a", second_prompt + t2.tokens + t3.tokens + t4.tokens)
        assert t5.body["hotload"]["prefix_cached_tokens"] > 0
        fresh = await turn("c", second_prompt)
        assert fresh.body["hotload"]["prefix_cached_tokens"] == 0

        cache = (await (await client.get("/hotload/v1/status")).json())["prefix_cache"]
        assert cache["hits"] == 4 and cache["dropped"] == 2
        metrics = await (await client.get("/metrics")).text()
        assert "hotload_engine_prefix_cache_hits_total 4.0" in metrics


# --- the command ---------------------------------------------------------------------------------


def test_serve_help_lists_the_options() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hotload", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    for option in ("--model", "--name", "--identity", "--sequence", "--max-batch", "--dtype"):
        assert option in out


def test_serve_command_runs_and_stops_cleanly(tiny: TinyLLM, tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "hotload", "serve", "--model", str(tmp_path / "missing")],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert bad.returncode == 1 and "does not exist" in bad.stderr

    # Outside the ephemeral range: a port from bind(0) can go to an outgoing connection
    # before the engine process, started later, binds it.
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotload", "serve", "--model", str(tiny.snapshots[0]),
         "--name", "tiny", "--sequence", "7", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:

        async def drive() -> None:
            base = f"http://127.0.0.1:{port}"
            async with ClientSession() as http:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        async with http.get(base + "/ready") as resp:
                            if resp.status == 200:
                                break
                    except OSError:
                        pass
                    assert time.monotonic() < deadline and proc.poll() is None
                    await asyncio.sleep(0.2)
                async with http.post(
                    base + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}
                ) as resp:
                    body = await resp.json()
                    assert resp.status == 200 and body["model"] == f"tiny@{tiny.identities[0]}"
                    assert body["hotload"]["sequence_end"] == 7

        asyncio.run(drive())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.stdout.read() if proc.stdout else ""
    assert "shutting down" in output


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_tiny_llm_snapshots_differ(tiny: TinyLLM) -> None:
    """The fixture's snapshots are distinct full snapshots of the same model."""
    from hotload.snapshot import validate_snapshot

    for path in tiny.snapshots:
        assert validate_snapshot(path).kind == "full"
    a = (tiny.snapshots[0] / "model-00002-of-00004.safetensors").read_bytes()
    b = (tiny.snapshots[1] / "model-00002-of-00004.safetensors").read_bytes()
    assert a != b
    assert shutil.which(sys.executable)


# --- the sidecar's adapter against this engine -------------------------------------------------


@pytest.mark.asyncio
async def test_reference_adapter_drives_the_real_engine(tiny: TinyLLM, tmp_path: Path) -> None:
    """The sidecar's `ReferenceAdapter` loads, confirms, reports health and keeps the old
    weights serving when the engine refuses a broken snapshot."""
    from hotload.errors import EngineLoadError
    from hotload_sidecar.engines import LoadRequest, ReferenceAdapter, ServedSnapshot

    broken = broken_snapshot(tiny.snapshots[2], tmp_path / "broken", "wrong_shape")
    async with serve(tiny.snapshots[0], "s0") as client:
        url = str(client.make_url("")).rstrip("/")
        async with ReferenceAdapter(url) as adapter:
            health = await adapter.health()
            assert health.live and health.ready, health
            before = await complete(client, PROMPTS[0], 12)

            result = await adapter.load(
                LoadRequest(str(tiny.snapshots[1]), "s1", 1, mode="sync", cache_policy="none")
            )
            assert result.served == ServedSnapshot("s1", 1)
            assert result.load_seconds >= result.pause_seconds >= 0
            assert not result.cache_reset
            assert await adapter.current() == ServedSnapshot("s1", 1)
            after = await complete(client, PROMPTS[0], 12)
            assert after.body["model"] == "tiny@s1" and after.tokens != before.tokens

            with pytest.raises(EngineLoadError) as info:
                await adapter.load(LoadRequest(str(broken), "s2-broken", 2))
            assert info.value.serving == "previous" and info.value.status == 422
            assert "q_proj" in str(info.value)
            assert await adapter.current() == ServedSnapshot("s1", 1)
            still = await complete(client, PROMPTS[0], 12)
            assert still.body["model"] == "tiny@s1" and still.tokens == after.tokens
