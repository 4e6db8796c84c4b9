"""Choosing the next token from a row of logits, and scoring a prompt's own tokens (vLLM's
`prompt_logprobs`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hotload.engine.protocol import SamplingParams
from hotload.engine.responses import PromptLogprobs, TokenScore


def pick_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Greedy (temperature 0) or temperature/top-p sampling of one row of logits."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        sorted_probs[(cum - sorted_probs) >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def prompt_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], top: int, text: Callable[[int], str]
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` from a prefill's logits ([n, vocab], row i predicts token i+1).

    Each position after the first gets its own token and the `top` most likely ones, each with
    its logprob (fp32 log-softmax of the logits), its 1-based rank and its text.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    out: PromptLogprobs = [None]
    for i in range(1, len(tokens)):
        row = logprobs[i - 1]
        token = int(tokens[i])
        own = row[token]
        entry = {
            str(token): {
                "logprob": float(own),
                # vLLM's rank: tokens at least as likely, itself included (ties rank low).
                "rank": int((row >= own).sum()),
                "decoded_token": text(token),
            }
        }
        if top > 0:
            values, ids = torch.topk(row, top)
            for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
                # The prompt's own token keeps its entry (and its rank among ties) when in the top.
                entry.setdefault(
                    str(tid), {"logprob": value, "rank": rank + 1, "decoded_token": text(tid)}
                )
        out.append(entry)
    return out


def token_score(
    logits: torch.Tensor, token: int, top: int, piece: Callable[[int], str]
) -> TokenScore:
    """The logprobs entry of `token` chosen from one row of logits: its logprob (fp32
    log-softmax of the raw logits, before temperature and top-p, as vLLM reports them) and
    the `top` most likely tokens."""
    row = torch.log_softmax(logits.float(), dim=-1).cpu()
    return _score(row, token, top, piece)


def prompt_scores(
    logits: torch.Tensor, tokens: Sequence[int], top: int, piece: Callable[[int], str]
) -> list[TokenScore]:
    """The logprobs entries of a prompt's own tokens from its prefill's logits ([n, vocab],
    row i predicts token i+1); the first has no logprob (nothing precedes it)."""
    rows = torch.log_softmax(logits.float(), dim=-1).cpu()
    first = TokenScore(int(tokens[0]), piece(int(tokens[0])), None)
    return [first] + [
        _score(rows[i - 1], int(tokens[i]), top, piece) for i in range(1, len(tokens))
    ]


def _score(row: torch.Tensor, token: int, top: int, piece: Callable[[int], str]) -> TokenScore:
    alternatives: tuple[tuple[int, str, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(row, top)
        alternatives = tuple(
            (tid, piece(tid), value)
            for value, tid in zip(values.tolist(), ids.tolist(), strict=True)
        )
    return TokenScore(token, piece(token), float(row[token]), alternatives)
