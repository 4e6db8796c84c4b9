"""The numerics check against two real reference engines (in-process, on real aiohttp servers).

The trainer side is transformers in float32 on the same snapshot folders. On the snapshot the
trainer holds, the engine's prompt logprobs must agree to float32 rounding (KL ~0); a replica on
another snapshot must show a clear divergence, reported under that snapshot's identity. The vLLM
CPU measurement lives in test_engine_vllm.py (it shares that module's vLLM server).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from hotload.sdk import NumericsReport, numerics_check_async
from hotload.sdk.numerics import compare_position, default_sequences
from support.engines import serve_engines
from support.tiny_llm import TinyLLM, build_tiny_llm

#: float32 rounding of logprobs around -10 (one ulp is 9.5e-7): the same weights, another kernel.
SAME_WEIGHTS_DIFF = 2e-6
SEQUENCES = [[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 2088, 999, 1996, 4937, 2938, 2006]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyLLM:
    """Snapshots s0 and s1 (s0 plus noise) of one tiny Llama."""
    return build_tiny_llm(tmp_path_factory.mktemp("numerics"), 1)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


#: Started reference engines named "policy" on `(folder, identity)` pairs.
replicas = serve_engines


def url(client: TestClient[Any, Any]) -> str:
    return str(client.make_url("")).rstrip("/")


# --- the engine's prompt logprobs ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_engine_answers_prompt_logprobs_like_vllm(tiny: TinyLLM) -> None:
    """vLLM's shape: None first, then per position the prompt's token (with its rank) and the
    top-k by rank; the generated token is the one a plain request gets."""
    prompt = SEQUENCES[1]
    async with replicas((tiny.snapshots[0], "s0")) as [client]:
        plain = await (await client.post("/v1/completions", json={"prompt": prompt})).json()
        resp = await client.post(
            "/v1/completions",
            json={"prompt": prompt, "prompt_logprobs": 3, "return_token_ids": True},
            headers={"x-session-affinity": "a"},
        )
        body = await resp.json()
        assert resp.status == 200, body
        # A session's cached prefix must not cut positions off the scored prompt.
        again = await (
            await client.post(
                "/v1/completions",
                json={"prompt": prompt, "prompt_logprobs": 3},
                headers={"x-session-affinity": "a"},
            )
        ).json()
        bad = await client.post("/v1/completions", json={"prompt": prompt, "prompt_logprobs": 21})
        streamed = await client.post(
            "/v1/completions", json={"prompt": prompt, "prompt_logprobs": 1, "stream": True}
        )
        assert bad.status == 400 and streamed.status == 400
        assert (await bad.json())["error"]["param"] == "prompt_logprobs"
    choice = body["choices"][0]
    assert choice["text"] == plain["choices"][0]["text"]
    assert choice["prompt_token_ids"] == prompt
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    for i, entry in enumerate(scored[1:], 1):
        own = entry[str(prompt[i])]
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(prompt[i]))
        assert ranks == [1, 2, 3] or (own["rank"] <= 3 and len(entry) == 3)
        assert own["logprob"] <= max(v["logprob"] for v in entry.values()) <= 0.0
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    assert again["choices"][0]["prompt_logprobs"] == scored


# --- the check -----------------------------------------------------------------------------------


def snapshot_of(report: NumericsReport, endpoint: str) -> dict[str, Any]:
    [replica] = [r for r in report.replicas if r.endpoint == endpoint]
    assert replica.error is None, replica.error
    return replica.snapshots


@pytest.mark.asyncio
async def test_same_snapshot_is_identical_and_another_diverges_by_name(tiny: TinyLLM) -> None:
    s0, s1 = tiny.snapshots
    async with replicas((s0, "s0"), (s1, "s1")) as [on_s0, on_s1]:
        a, b = url(on_s0), url(on_s1)
        report = await numerics_check_async(s0, [a, b], SEQUENCES, top_k=5)
        same = snapshot_of(report, a)
        assert list(same) == ["s0"]
        assert same["s0"].positions == sum(len(s) - 1 for s in SEQUENCES)
        assert same["s0"].max_abs_diff < SAME_WEIGHTS_DIFF
        assert same["s0"].topk_max_abs_diff < SAME_WEIGHTS_DIFF
        assert same["s0"].kl_max < 1e-10 and same["s0"].top1_agreement == 1.0
        other = snapshot_of(report, b)["s1"]
        assert other.max_abs_diff > 0.01 and other.kl_max > 1e-6
        assert set(report.snapshots) == {"s0", "s1"}
        assert report.divergence.max_abs_diff == other.max_abs_diff

        # After a hot load of s0 the second replica agrees too; the trainer side is a callable.
        load = {"path": str(s0), "identity": "s0-again", "sequence": 2}
        assert (await on_s1.post("/hotload/v1/load", json=load)).status == 200
        import torch
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(s0, dtype=torch.float32)
        model.eval()

        def trainer(ids: list[int]) -> Any:
            return model(torch.tensor([ids])).logits[0]

        report = await numerics_check_async(trainer, [b], SEQUENCES, top_k=5)
        loaded = snapshot_of(report, b)
        assert list(loaded) == ["s0-again"] and loaded["s0-again"].max_abs_diff < SAME_WEIGHTS_DIFF
        assert report.reference == "trainer"


def test_the_kl_is_exact_on_full_reports_and_a_lower_bound_on_top_k() -> None:
    """With every token reported the coarse KL is the full KL; with fewer it is never more."""
    import numpy as np

    rng = np.random.default_rng(0)
    p_logits, q_logits = rng.normal(size=50), rng.normal(size=50)
    p = p_logits - np.log(np.exp(p_logits).sum())
    q = q_logits - np.log(np.exp(q_logits).sum())
    full_kl = float((np.exp(p) * (p - q)).sum())
    everything = compare_position(1, 7, p, {t: float(q[t]) for t in range(50)}, None)
    assert everything.kl == pytest.approx(full_kl, rel=1e-9)
    top = {int(t): float(q[t]) for t in np.argsort(-q)[:5]} | {7: float(q[7])}
    partial = compare_position(1, 7, p, top, int(np.argmax(q)))
    assert 0.0 < partial.kl < full_kl
    assert partial.abs_diff == pytest.approx(abs(p[7] - q[7]))
    assert partial.top1_agree == (int(np.argmax(p)) == int(np.argmax(q)))


# --- the command ---------------------------------------------------------------------------------


async def cli(*argv: str) -> int:
    """`hotload numerics ...` in a thread (the engines serve on this loop); its exit code."""
    from hotload.cli.main import run

    return await asyncio.to_thread(run, ["numerics", *argv])


@pytest.mark.asyncio
async def test_cli_exit_codes_and_outputs(
    tiny: TinyLLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s0, s1 = tiny.snapshots
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# token ids or text\n[101, 2023, 2003, 1037]\n\nthe chef cooked a boat\n")
    async with replicas((s0, "s0"), (s1, "s1")) as [on_s0, on_s1]:
        a, b = url(on_s0), url(on_s1)
        base = ["--model", str(s0), "--prompts-file", str(prompts), "--top-k", "4"]
        assert await cli(*base, "--replicas", a, "--max-kl", "1e-9", "-o", "json") == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["problems"] == [] and doc["sequences"] == 2
        assert doc["replicas"][0]["snapshots"]["s0"]["max_abs_diff"] < SAME_WEIGHTS_DIFF

        assert await cli(*base, "--replicas", f"{a},{b}", "--max-kl", "1e-6") == 1
        out = capsys.readouterr().out
        assert "s1" in out and "FAILED: KL" in out

        # The built-in sequences; a replica that cannot be reached fails the check.
        assert await cli("--model", str(s0), "--replicas", f"{a},http://127.0.0.1:9") == 1
        assert "FAILED: http://127.0.0.1:9" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        await cli("--replicas", a)
    assert usage.value.code == 2


def test_default_sequences_are_fixed_and_inside_the_vocabulary() -> None:
    first = default_sequences(100)
    assert first == default_sequences(100)
    assert [len(s) for s in first] == [8, 16, 32, 64]
    assert all(0 <= t < 100 for s in first for t in s)
