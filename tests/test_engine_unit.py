"""Unit tests of the engine's pure parts: the HTTP contract, detokenisation, the prefix cache,
the batch's KV bookkeeping and token picking."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hotload.engine.batch import BatchKV, crop, kv_length
from hotload.engine.exact import pad_rows_linear, probe_row_sizes
from hotload.engine.protocol import (
    ApiError,
    GenerationRequest,
    SamplingParams,
    ServedSnapshot,
    VersionConstraint,
    check_constraint,
    parse_generation_request,
    parse_load_request,
    render_chat_fallback,
    session_id,
)
from hotload.engine.responses import (
    Outcome,
    completion_body,
    final_chunk,
    models_body,
    sse,
    stream_chunk,
)
from hotload.engine.sampling import pick_token
from hotload.engine.sessions import SessionCache, common_prefix
from hotload.engine.text import TextAssembler

SERVED = ServedSnapshot("step-7", 7)


def parse(body: Any, kind: str = "completion", headers: dict[str, str] | None = None):
    return parse_generation_request(body, kind, headers or {}, "policy")  # type: ignore[arg-type]


def api_error(fn: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


# --- requests ------------------------------------------------------------------------------------


def test_completion_defaults_are_greedy_and_openai_like() -> None:
    req = parse({"prompt": "hi"})
    assert req.kind == "completion" and req.prompt == "hi" and not req.stream
    assert req.sampling == SamplingParams(max_tokens=16)
    assert req.constraint == VersionConstraint()
    chat = parse({"messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert chat.sampling.max_tokens == 256 and not chat.max_tokens_given
    assert chat.messages == [{"role": "user", "content": "hi"}]
    assert parse({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert parse({"prompt": ["only one"]}).prompt == "only one"
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert parse({"messages": [parts]}, "chat").messages[0]["content"] == "ab"
    assert (
        parse({"messages": [{"role": "u"}], "max_completion_tokens": 3}, "chat").sampling.max_tokens
        == 3
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "include_routing_matrix": True}, "include_routing_matrix"),
        ({"prompt": "x", "logprobs": 0, "include_routing_matrix": 1}, "include_routing_matrix"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "min_snapshot_sequence": -1}, "min_snapshot_sequence"),
        ({"prompt": "x", "snapshot_identity": ""}, "snapshot_identity"),
    ],
)
def test_bad_completion_fields_are_named(body: dict[str, Any], param: str) -> None:
    err = api_error(parse, body)
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"


def test_logprobs_echo_and_routes_are_parsed_per_endpoint() -> None:
    """Completions take `logprobs` as the top-k; chat takes `logprobs: true` and
    `top_logprobs`; routes ride on logprobs, echo is completions' only."""
    req = parse({"prompt": "x", "logprobs": 3, "echo": True, "include_routing_matrix": True})
    assert (req.logprobs, req.echo, req.routes) == (3, True, True)
    assert parse({"prompt": "x", "logprobs": 0}).logprobs == 0
    assert parse({"prompt": "x", "logprobs": False}).logprobs is None
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse({**chat, "logprobs": True}, "chat").logprobs == 0
    assert parse({**chat, "logprobs": True, "top_logprobs": 5}, "chat").logprobs == 5
    assert parse(chat, "chat").logprobs is None
    for body, param in [
        ({**chat, "top_logprobs": 2}, "top_logprobs"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**chat, "logprobs": 2}, "logprobs"),
        ({**chat, "echo": True}, "echo"),
        ({**chat, "include_routing_matrix": True}, "include_routing_matrix"),
    ]:
        err = api_error(lambda b: parse(b, "chat"), body)
        assert err.status == 400 and err.param == param, body


def test_chat_messages_are_checked() -> None:
    for messages, param in [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ]:
        err = api_error(parse, {"messages": messages}, "chat")
        assert err.status == 400 and err.param == param


def test_model_field_and_constraints_combine() -> None:
    assert parse({"prompt": "x", "model": "policy"}).constraint == VersionConstraint()
    assert parse({"prompt": "x", "model": "policy@step-3"}).constraint.identity == "step-3"
    err = api_error(parse, {"prompt": "x", "model": "other@step-3"})
    assert err.status == 404 and err.type == "model_not_found" and "'policy'" in err.message
    headers = {"x-hotload-min-sequence": "5", "x-hotload-snapshot": "step-9"}
    c = parse({"prompt": "x", "min_snapshot_sequence": 7}, headers=headers).constraint
    assert c == VersionConstraint(7, "step-9")  # the stricter minimum wins
    err = api_error(parse, {"prompt": "x"}, "completion", {"x-hotload-min-sequence": "five"})
    assert err.status == 400 and err.param == "x-hotload-min-sequence"
    err = api_error(parse, {"prompt": "x", "snapshot_identity": "a", "model": "policy@b"})
    assert err.status == 400 and "conflicting" in err.message


def test_constraints_against_the_served_snapshot() -> None:
    assert VersionConstraint().unmet(SERVED) is None
    assert VersionConstraint(7, "step-7").unmet(SERVED) is None
    assert VersionConstraint(min_sequence=8).unmet(SERVED) is not None
    assert VersionConstraint(identity="step-8").unmet(SERVED) is not None
    err = api_error(check_constraint, VersionConstraint(min_sequence=9), SERVED)
    assert err.status == 409 and err.headers == {"Retry-After": "1"}
    body = err.body()["error"]
    assert body["type"] == "snapshot_unavailable"
    assert body["served_identity"] == "step-7" and body["served_sequence"] == 7
    assert body["message"].endswith("serves step-7 (sequence 7)")


def test_load_request_defaults_and_errors() -> None:
    req = parse_load_request({"path": "/w/s1", "identity": "s1", "sequence": 1})
    assert (req.mode, req.cache_policy) == ("async", "all")
    req = parse_load_request(
        {"path": "/w", "identity": "s1", "sequence": 0, "mode": "sync", "cache_policy": "none"}
    )
    assert (req.mode, req.cache_policy, req.sequence) == ("sync", "none", 0)
    for body, param in [
        ([], None),
        ({"identity": "s", "sequence": 1}, "path"),
        ({"path": "/w", "sequence": 1}, "identity"),
        ({"path": "/w", "identity": "../x", "sequence": 1}, "identity"),
        ({"path": "/w", "identity": "s"}, "sequence"),
        ({"path": "/w", "identity": "s", "sequence": True}, "sequence"),
        ({"path": "/w", "identity": "s", "sequence": 1, "mode": "ASYNC"}, "mode"),
        ({"path": "/w", "identity": "s", "sequence": 1, "cache_policy": "some"}, "cache_policy"),
    ]:
        err = api_error(parse_load_request, body)
        assert err.status == 400 and err.param == param, body


def test_session_header_preference() -> None:
    assert session_id({}) is None
    assert session_id({"x-session-affinity": "b"}) == "b"
    assert session_id({"x-multi-turn-session-id": "a", "x-session-affinity": "b"}) == "a"
    assert session_id({"x-multi-turn-session-id": "  ", "x-session-affinity": "b"}) == "b"


def test_chat_fallback_template() -> None:
    text = render_chat_fallback(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text == "system: be brief\nuser: hi\nassistant:"


# --- responses -----------------------------------------------------------------------------------


def test_response_bodies_name_start_and_end_snapshots() -> None:
    req = parse({"prompt": "x", "return_token_ids": True})
    out = Outcome(
        text="ab",
        token_ids=[5, 6],
        finish_reason="length",
        prompt_tokens=3,
        start=ServedSnapshot("s1", 1),
        end=ServedSnapshot("s2", 2),
        cached_tokens=1,
        prompt_ids=[1, 2, 3],
    )
    body = completion_body(req, "policy", "cmpl-1", 10, out)
    assert body["model"] == "policy@s2" and body["object"] == "text_completion"
    assert body["choices"][0] == {
        "index": 0,
        "finish_reason": "length",
        "logprobs": None,
        "text": "ab",
        "token_ids": [5, 6],
        "prompt_token_ids": [1, 2, 3],
    }
    assert body["hotload"] == {
        "identity_start": "s1",
        "identity_end": "s2",
        "sequence_start": 1,
        "sequence_end": 2,
        "prefix_cached_tokens": 1,
    }
    assert body["usage"]["total_tokens"] == 5
    chunk = stream_chunk(req, "policy", "cmpl-1", 10, ServedSnapshot("s1", 1), text="a", token_id=5)
    assert chunk["model"] == "policy@s1" and chunk["choices"][0]["text"] == "a"
    last = final_chunk(req, "policy", "cmpl-1", 10, out)
    assert (
        last["choices"][0]["finish_reason"] == "length" and last["hotload"]["identity_end"] == "s2"
    )
    chat = parse({"messages": [{"role": "user", "content": "x"}]}, "chat")
    assert completion_body(chat, "p", "c", 1, out)["choices"][0]["message"]["content"] == "ab"
    first = stream_chunk(chat, "p", "c", 1, SERVED, text="", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and sse("[DONE]") == b"data: [DONE]\n\n"
    models = models_body("policy", SERVED, 5)
    assert models["data"][0]["id"] == "policy@step-7" and models["data"][0]["owned_by"] == "hotload"
    assert json.loads(json.dumps(body)) == body


def test_api_error_body() -> None:
    err = ApiError(422, "weights_mismatch", "bad", extra={"k": 1})
    assert err.body() == {"error": {"type": "weights_mismatch", "message": "bad", "k": 1}}


# --- detokenisation ------------------------------------------------------------------------------


def wordpiece(vocab: dict[int, str]) -> Any:
    """A decoder like BERT's: "##x" pieces glue to the previous word, others add a space."""

    def decode(ids: Sequence[int]) -> str:
        out = ""
        for i in ids:
            piece = vocab[i]
            out += piece[2:] if piece.startswith("##") else (" " + piece if out else piece)
        return out

    return decode


VOCAB = {0: "walk", 1: "##ing", 2: "to", 3: "the", 4: "park", 5: "##s", 6: "stop", 7: "."}


def test_text_assembler_holds_back_possible_stop_strings() -> None:
    asm = TextAssembler(wordpiece(VOCAB), stop=["the park"])
    deltas = [asm.add([0, 1, 2, 3, 4][: n + 1]) for n in range(5)]
    assert asm.stopped and asm.text == "walking to "
    assert "".join(deltas) + asm.finish() == "walking to "
    assert "the" not in "".join(deltas)


def test_text_assembler_holds_back_everything_shorter_than_a_stop_string() -> None:
    # "s to" is shorter than the hold-back of "to the": releasing "s t" would leak a stop prefix.
    asm = TextAssembler(wordpiece(VOCAB), stop=["to the"])
    released = asm.add([5]) + asm.add([5, 2]) + asm.add([5, 2, 3])
    assert asm.stopped and asm.text == "s " and released + asm.finish() == "s "


def test_text_assembler_without_stop_releases_everything() -> None:
    asm = TextAssembler(wordpiece(VOCAB))
    assert asm.add([0]) == "walk" and asm.add([0, 1]) == "ing" and asm.add([0, 1, 2]) == " to"
    assert not asm.stopped and asm.finish() == ""


@given(st.lists(st.integers(0, 7), min_size=1, max_size=30), st.sampled_from(["", "s.", "to the"]))
def test_text_assembler_deltas_add_up_to_the_text(ids: list[int], stop: str) -> None:
    asm = TextAssembler(wordpiece(VOCAB), stop=[stop] if stop else [])
    released = ""
    for n in range(1, len(ids) + 1):
        released += asm.add(ids[:n])
        if asm.stopped:
            break
    released += asm.finish()
    assert released == asm.text
    if stop:
        assert stop not in asm.text


# --- the prefix cache ----------------------------------------------------------------------------


def test_prefix_cache_reuses_the_longest_common_prefix() -> None:
    cache: SessionCache[str] = SessionCache()
    assert cache.lookup("a", [1, 2, 3]) is None and cache.stats.misses == 1
    assert cache.lookup(None, [1, 2, 3]) is None and cache.stats.misses == 1  # no session
    cache.store("a", [1, 2, 3, 4], "kv-a", "s0")
    hit = cache.lookup("a", [1, 2, 3, 4, 5, 6])
    assert hit is not None and (hit.length, hit.kv, hit.identity) == (4, "kv-a", "s0")
    hit = cache.lookup("a", [1, 2, 9, 9])
    assert hit is not None and hit.length == 2  # diverges after two tokens
    hit = cache.lookup("a", [1, 2, 3, 4])
    assert hit is not None and hit.length == 3  # the last prompt token always runs
    assert cache.lookup("a", [7, 8]) is None
    assert cache.lookup("b", [1, 2, 3, 4, 5]) is None
    assert (cache.stats.hits, cache.stats.reused_tokens) == (3, 9)


def test_prefix_cache_is_bounded_and_follows_policies() -> None:
    cache: SessionCache[int] = SessionCache(max_sessions=2, max_tokens=10)
    cache.store("a", [1, 2, 3], 1, "s0")
    cache.store("b", [1, 2, 3], 2, "s0")
    cache.lookup("a", [1, 2, 3, 4])  # a becomes the most recently used
    cache.store("c", [1, 2, 3], 3, "s0")
    assert cache.lookup("b", [1, 2, 3, 4]) is None and cache.stats.evicted == 1
    cache.store("d", list(range(8)), 4, "s0")  # 3 + 3 + 8 > 10 tokens: evict the oldest
    assert len(cache) <= 2 and cache.tokens <= 10
    cache.store("huge", list(range(11)), 5, "s0")  # bigger than the whole budget: not kept
    assert cache.lookup("huge", list(range(12))) is None
    assert cache.apply_policy("none") == 0 and cache.apply_policy("new_session") == 0
    kept = len(cache)
    assert cache.apply_policy("all") == kept and len(cache) == 0 and cache.tokens == 0
    assert SessionCache[int](max_sessions=0).lookup("a", [1]) is None
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


# --- batch bookkeeping and sampling ------------------------------------------------------------


def row_kv(length: int, fill: float, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.full((1, 2, length, 4), fill)
    return [(t.clone(), t.clone() + 0.5) for _ in range(layers)]


def test_batch_left_pads_rows_and_trims_on_removal() -> None:
    batch = BatchKV()
    batch.add(row_kv(3, 1.0))
    batch.add(row_kv(5, 2.0))
    batch.add(row_kv(2, 3.0))
    assert batch.rows == 3 and batch.columns == 5
    assert batch.pads == [2, 0, 3] and batch.lengths() == [3, 5, 2]
    keys = batch.layers[0][0]
    assert torch.all(keys[0, :, :2] == 0) and torch.all(keys[0, :, 2:] == 1.0)
    assert torch.equal(batch.row(2)[1][1], row_kv(2, 3.0)[1][1])
    batch.keep([0, 2])  # the longest row leaves: two columns are padding for everyone
    assert batch.pads == [0, 1] and batch.columns == 3 and batch.lengths() == [3, 2]
    assert torch.equal(batch.row(1)[0][0], row_kv(2, 3.0)[0][0])
    batch.keep([])
    assert batch.rows == 0 and batch.columns == 0
    assert kv_length(crop(row_kv(6, 1.0), 4)) == 4


def test_pick_token_greedy_top_p_and_seeded_sampling() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert pick_token(logits, SamplingParams(max_tokens=1), None) == 1
    narrow = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01)
    assert all(pick_token(logits, narrow, torch.Generator().manual_seed(s)) == 1 for s in range(20))
    hot = SamplingParams(max_tokens=1, temperature=1.5, seed=3)

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [pick_token(logits, hot, gen) for _ in range(30)]

    assert draw(3) == draw(3) and len(set(draw(3))) > 1


def test_padded_linear_matches_plain_linear() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(3, 7, 24)
    expected = layer(x)
    pad_rows_linear(layer, sizes=[2, 6], max_rows=8)  # 21 rows: blocks of 8, 8 and 5 (+1 zero row)
    got = layer(x)
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(layer(x[0, 0]), expected[0, 0], atol=1e-6)  # a single vector


def test_generation_request_is_frozen() -> None:
    req = parse({"prompt": "x"})
    assert isinstance(req, GenerationRequest)
    with pytest.raises(AttributeError):
        req.stream = True  # type: ignore[misc]


def test_run_in_thread_returns_raises_and_lowers_priority() -> None:
    import asyncio
    import os
    import threading

    from hotload.engine.engine import run_in_thread

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> tuple[int, int]:
        base = await run_in_thread(niceness)
        lowered = await run_in_thread(niceness, nice=3)
        with pytest.raises(ValueError, match="boom"):
            await run_in_thread(fail)
        return base, lowered

    base, lowered = asyncio.run(main())
    assert lowered == min(base + 3, 19)


def test_row_size_probe_keeps_only_sizes_that_reproduce_large_blocks() -> None:
    weights = [torch.randn(48, 24), torch.randn(40, 24)]
    sizes = probe_row_sizes(weights, max_rows=40, small=8)
    if sizes is not None:  # depends on this machine's BLAS; the shape of the answer does not
        assert sizes[-1] == 9 and sizes == sorted(sizes) and all(1 <= s <= 9 for s in sizes)
        x = torch.randn(40, 24)
        for w in weights:
            ref = torch.nn.functional.linear(x, w)
            for s in sizes[:-1]:
                assert torch.equal(torch.nn.functional.linear(x[:s], w), ref[:s])


def test_device_auto_takes_the_gpu_only_when_there_is_one() -> None:
    import torch

    from hotload.engine.model import resolve_device
    from hotload.errors import SnapshotError

    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(SnapshotError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(SnapshotError, match="unsupported device"):
        resolve_device("mps")
