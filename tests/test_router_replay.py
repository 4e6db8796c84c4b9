"""Router Replay end to end: a tiny Qwen3-MoE served by the reference engine answers with each
token's logprobs and routes, and the trainer's transformers forward under `replay_routes`
sends every token of every layer to exactly those experts.

Real parts: the family's own `save_pretrained` checkpoint, `hotload snapshot build`'s writer,
the reference engine behind its aiohttp server, transformers' Qwen3-MoE as the trainer's model.
What the forward selected is read at the experts module's input (a pre-hook of the test's
own), not from the replay hook; the expected experts are the engine's answer, and the
trainer's weights are perturbed on purpose so that its own routers disagree.
"""

from __future__ import annotations

import asyncio
import base64
import math
from pathlib import Path
from typing import Any

import pytest

from hotload.routes import RouteFormat, RoutesError, decode_routes, encode_routes
from hotload.sdk import RolloutRoutes, replay_routes
from hotload.snapshot import build_from_folder
from support.engines import complete, serve
from support.families import FAMILIES, save_family

PROMPT = [101, 2023, 3899, 2001, 1037, 2417, 2341, 1999]
IDENTITY = "step-00007"


@pytest.fixture(scope="module")
def moe_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2) as a hotload snapshot."""
    root = tmp_path_factory.mktemp("moe")
    folder = save_family(FAMILIES["qwen3-moe"], root / "hf", seed=3)
    return build_from_folder(folder, root / "snapshot").path


def _trainer_model(snapshot: Path, *, perturb: float = 0.0) -> Any:
    """The trainer's copy of the snapshot's weights (float32); `perturb` adds noise of that
    standard deviation to every router so that its own choices move."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    if perturb:
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.add_(torch.randn(param.shape, generator=gen) * perturb)
    return model


def _selected(model: Any, ids: list[int], **replay: Any) -> tuple[list[Any], list[Any], Any]:
    """One training forward of `ids`: what each MoE layer's experts were handed (expert ids
    and routing weights, read at the experts' input) and the output logits."""
    import torch

    seen: list[Any] = []
    handles = [
        layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args: seen.append((args[1].detach().clone(), args[2]))
        )
        for layer in model.model.layers
    ]
    try:
        if replay:
            with replay_routes(model, **replay):
                out = model(torch.tensor([ids]))
        else:
            out = model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return [s[0] for s in seen], [s[1] for s in seen], out.logits


async def _rollout(client: Any, **extra: Any) -> dict[str, Any]:
    body = {
        "logprobs": 2,
        "echo": True,
        "include_routing_matrix": True,
        "temperature": 0.8,
        "seed": 5,
        "ignore_eos": True,
        **extra,
    }
    result = await complete(client, PROMPT, 8, **body)
    assert result.status == 200, result.body
    return result.body


@pytest.mark.asyncio
async def test_the_trainer_replays_exactly_the_experts_the_engine_routed(
    moe_snapshot: Path,
) -> None:
    import torch

    async with serve(moe_snapshot, IDENTITY, 7, dtype="float32") as client:
        body = await _rollout(client)
    sample = RolloutRoutes.from_response(body)
    completion = body["choices"][0]["token_ids"]
    assert sample.token_ids == PROMPT + completion
    assert sample.snapshot == IDENTITY and sample.prompt_tokens == len(PROMPT)
    assert sample.layout == RouteFormat(layers=2, top_k=2, experts=4, dtype="uint8")
    # Every token was fed but the last generated one.
    assert all(r is not None for r in sample.routes[:-1]) and sample.routes[-1] is None

    ids = sample.token_ids
    # The engine's routes are the snapshot's own: transformers on the same weights routes
    # every fed token of every layer the same way (entry j: the pass where token j is input).
    same, _, _ = _selected(_trainer_model(moe_snapshot), ids)
    for layer in range(2):
        for j, routes in enumerate(sample.routes[:-1]):
            assert routes is not None
            assert sorted(same[layer][j].tolist()) == sorted(routes[layer]), (layer, j)

    model = _trainer_model(moe_snapshot, perturb=0.5)
    live, _, _ = _selected(model, ids)
    replayed, weights, logits = _selected(model, ids, samples=sample, snapshot=IDENTITY)
    disagree = 0
    for layer in range(2):
        for j, routes in enumerate(sample.routes):
            if routes is None:
                continue
            assert sorted(replayed[layer][j].tolist()) == sorted(routes[layer]), (layer, j)
            disagree += sorted(live[layer][j].tolist()) != sorted(routes[layer])
    # The perturbed routers pick other experts for some tokens: replay is what made them agree.
    assert disagree > 0

    # The routing weights are the live router's softmax at the forced experts (renormalised
    # over them with norm_topk_prob), so the router still learns: its gradient is not zero.
    gate = model.model.layers[0].mlp.gate
    router_logits = torch.nn.functional.linear(
        model.model.layers[0]
        .post_attention_layernorm(_hidden_before_mlp(model, ids))
        .reshape(-1, gate.hidden_dim),
        gate.weight,
    )
    probs = torch.softmax(router_logits.float(), dim=-1).gather(-1, replayed[0])
    if model.config.norm_topk_prob:
        probs = probs / probs.sum(-1, keepdim=True)
    assert torch.allclose(weights[0], probs, atol=1e-6)
    loss = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).sum()
    loss.backward()
    assert gate.weight.grad is not None and float(gate.weight.grad.abs().sum()) > 0


def _hidden_before_mlp(model: Any, ids: list[int]) -> Any:
    """Layer 0's residual stream after attention (the MoE block's input before its norm)."""
    import torch

    got: list[Any] = []
    layer = model.model.layers[0]
    handle = layer.post_attention_layernorm.register_forward_pre_hook(
        lambda _m, args: got.append(args[0].detach())
    )
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    return got[0]


@pytest.mark.asyncio
async def test_logprobs_are_the_served_weights_own_and_streaming_says_the_same(
    moe_snapshot: Path,
) -> None:
    """Each generated token's logprob (and top-2) is the log-softmax of the snapshot's logits
    at that position (transformers on the same weights); a stream carries the same entries,
    one per token chunk, and the same routes."""
    import torch

    async with serve(moe_snapshot, IDENTITY, 7, dtype="float32") as client:
        body = await _rollout(client, temperature=0.0)
        streamed = await complete(
            client,
            PROMPT,
            8,
            stream=True,
            logprobs=2,
            echo=True,
            include_routing_matrix=True,
            temperature=0.0,
            ignore_eos=True,
        )
    content = body["choices"][0]["logprobs"]["content"]
    ids = [e["token_id"] for e in content]
    model = _trainer_model(moe_snapshot)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert content[0]["logprob"] is None  # nothing precedes the prompt's first token
    for j in range(1, len(ids)):
        assert math.isclose(content[j]["logprob"], float(reference[j - 1, ids[j]]), abs_tol=1e-3)
        top = [e["token_id"] for e in content[j]["top_logprobs"]]
        assert top == torch.topk(reference[j - 1], 2).indices.tolist()
    legacy = body["choices"][0]["logprobs"]
    assert legacy["token_logprobs"] == [e["logprob"] for e in content]
    from transformers import AutoTokenizer

    prompt_text = AutoTokenizer.from_pretrained(moe_snapshot).decode(
        PROMPT, skip_special_tokens=True
    )
    assert body["choices"][0]["text"].startswith(prompt_text)  # echo

    chunks = streamed.chunks
    sample = RolloutRoutes.from_chunks(chunks)
    assert sample == RolloutRoutes.from_response(body)
    # The prompt comes first as one chunk, then one chunk per generated token.
    per_chunk = [len((c["choices"][0]["logprobs"] or {}).get("content", [])) for c in chunks]
    assert per_chunk[0] == len(PROMPT) and per_chunk[1:9] == [1] * 8
    assert not any(per_chunk[9:])


@pytest.mark.asyncio
async def test_routes_from_another_snapshot_or_across_a_hot_load_are_refused(
    moe_snapshot: Path,
) -> None:
    async with serve(moe_snapshot, IDENTITY, 7, dtype="float32") as client:
        body = await _rollout(client)
        no_echo = await complete(client, PROMPT, 2, logprobs=0, include_routing_matrix=True)
        no_logprobs = await complete(client, PROMPT, 2, include_routing_matrix=True)
    assert no_echo.status == 200
    assert no_logprobs.status == 400
    assert no_logprobs.body["error"]["param"] == "include_routing_matrix"
    sample = RolloutRoutes.from_response(body)
    model = _trainer_model(moe_snapshot)
    held = f"come from snapshot {IDENTITY}, the trainer holds step-00008"
    with (
        pytest.raises(RoutesError, match=held),
        replay_routes(model, sample, snapshot="step-00008"),
    ):
        pass
    across = {**body, "hotload": {**body["hotload"], "identity_end": "step-00008"}}
    with pytest.raises(RoutesError, match=r"across a hot load \(step-00007 -> step-00008\)"):
        RolloutRoutes.from_response(across)
    # Without echo the prompt's routes are missing: the trainer is told what to ask for.
    with pytest.raises(RoutesError, match='"echo": true'):
        RolloutRoutes.from_response(no_echo.body)
    # A forward over other tokens than the sample's is refused, not silently misrouted.
    import torch

    shorter = torch.tensor([sample.token_ids[:-1]])
    with (
        pytest.raises(RoutesError, match="routes cover 1 sample"),
        replay_routes(model, sample, snapshot=IDENTITY),
    ):
        model(shorter)


@pytest.mark.asyncio
async def test_a_dense_model_refuses_routes_naming_the_field(tmp_path: Path) -> None:
    folder = save_family(FAMILIES["qwen3"], tmp_path / "hf", seed=1)
    snapshot = build_from_folder(folder, tmp_path / "snapshot").path
    async with serve(snapshot, "dense", 1, dtype="float32") as client:
        result = await complete(client, PROMPT, 2, logprobs=0, include_routing_matrix=True)
        plain = await complete(client, PROMPT, 2, logprobs=3, echo=True)
    assert result.status == 400
    assert result.body["error"]["param"] == "include_routing_matrix"
    assert "qwen3 is not a mixture of experts" in result.body["error"]["message"]
    assert plain.status == 200
    lp = plain.body["choices"][0]["logprobs"]
    assert len(lp["content"]) == len(PROMPT) + 2
    assert all("routing_matrix" not in e for e in lp["content"])
    assert all(len(e["top_logprobs"]) == 3 for e in lp["content"][1:])


def test_the_wire_form_round_trips_and_names_what_is_wrong() -> None:
    narrow = RouteFormat(layers=3, top_k=2, experts=128, dtype="uint8")
    wide = RouteFormat(layers=3, top_k=2, experts=384, dtype="uint16")
    ids = [[0, 127], [5, 6], [100, 1]]
    assert decode_routes(encode_routes([i for row in ids for i in row], narrow), narrow) == ids
    big = [[383, 256], [0, 1], [300, 2]]
    encoded = encode_routes([i for row in big for i in row], wide)
    assert len(base64.b64decode(encoded)) == 12
    assert decode_routes(encoded, wide) == big
    with pytest.raises(RoutesError, match="has 12 bytes; 3 layers of top-2 as uint8 take 6"):
        decode_routes(encoded, narrow)
    with pytest.raises(RoutesError, match="names expert 383; the model has 128"):
        decode_routes(encoded, RouteFormat(3, 2, 128, "uint16"))
    with pytest.raises(RoutesError, match="not base64"):
        decode_routes("***", narrow)


@pytest.mark.asyncio
async def test_the_front_and_the_router_pass_logprobs_and_routes_through_unchanged(
    moe_snapshot: Path,
) -> None:
    """The same greedy rollout asked of the engine, through its front and through the router
    (static discovery) gives the same logprobs entries, routes and `hotload` block."""
    from aiohttp.test_utils import TestClient, TestServer

    from hotload.router.discovery import StaticDiscovery
    from hotload.router.front import EngineFront, FrontConfig, create_front_app
    from hotload.router.proxy import Router, create_router_app

    async with serve(moe_snapshot, IDENTITY, 7, dtype="float32") as engine:
        url = str(engine.make_url("")).rstrip("/")
        direct = await _rollout(engine, temperature=0.0)
        front = TestClient(
            TestServer(create_front_app(EngineFront(url, FrontConfig())), host="127.0.0.1")
        )
        router = Router(StaticDiscovery([url], interval=0.1))
        routed = TestClient(TestServer(create_router_app(router), host="127.0.0.1"))
        await front.start_server()
        await routed.start_server()
        try:
            for _ in range(100):  # the router's first look at the replica
                if (await routed.get("/ready")).status == 200:
                    break
                await asyncio.sleep(0.1)
            answers = [
                await _rollout(front, temperature=0.0),
                await _rollout(routed, temperature=0.0),
            ]
        finally:
            await routed.close()
            await front.close()
    for answer in answers:
        assert answer["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]
        assert answer["hotload"] == direct["hotload"]
        assert RolloutRoutes.from_response(answer) == RolloutRoutes.from_response(direct)


@pytest.mark.asyncio
async def test_the_documented_grpo_step_runs_under_replay(moe_snapshot: Path) -> None:
    """docs/router-replay.md's GRPO-style step, on two sampled completions of one prompt: the
    ratio is computed through the engine's experts and the router gets a gradient."""
    import torch

    async with serve(moe_snapshot, IDENTITY, 7, dtype="float32") as client:
        group = [await _rollout(client, seed=s) for s in (1, 2)]
    model = _trainer_model(moe_snapshot)
    trainer_identity = IDENTITY
    advantages = [1.0, -1.0]
    samples = [RolloutRoutes.from_response(r) for r in group]
    served = {s.snapshot for s in samples}
    assert served == {trainer_identity}, served
    ratios = []
    for sample, advantage in zip(samples, advantages, strict=True):
        ids = torch.tensor([sample.token_ids])
        start = sample.prompt_tokens
        with replay_routes(model, sample, snapshot=trainer_identity):
            logits = model(ids).logits[0, start - 1 : -1]
        new = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, start:, None])[:, 0]
        old = torch.tensor(sample.logprobs[start:])
        ratio = torch.exp(new - old)
        loss = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean()
        loss.backward()
        ratios.append(ratio.detach())
    # Same weights, same experts: the engine's logprobs and the trainer's agree to float32
    # rounding, so the importance ratio is 1.
    assert all(torch.allclose(r, torch.ones_like(r), atol=1e-3) for r in ratios), ratios
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0
