"""Per-session prompt (prefix) cache: reuse a session's KV cache when its next prompt extends it.

Multi-turn rollouts send the whole conversation each turn; the previous turn's tokens (prompt
and completion) are already in the KV cache it left behind. The cache keeps, per session, the
token ids whose keys and values are known and the KV itself (opaque here: the model owns its
layout). A lookup returns the longest common prefix of those tokens and the new prompt, so a
prompt that re-tokenises the previous completion slightly differently still reuses everything
up to the first difference. Reuse is exact: keys and values at a position depend only on the
tokens up to it, and the engine computes them the same way whether or not they came from here.

Swaps apply the snapshot's prompt-cache policy (`apply_policy`): `all` drops every entry,
`none` and `new_session` keep them (the entries then hold keys and values of the previous
weights, which is what those policies accept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from hotload.engine.protocol import CachePolicy

KV = TypeVar("KV")


@dataclass(frozen=True)
class CacheEntry(Generic[KV]):
    """One session's cached tokens, their KV and the snapshot that computed it."""

    tokens: tuple[int, ...]
    kv: KV
    identity: str


@dataclass(frozen=True)
class PrefixHit(Generic[KV]):
    """A usable cached prefix: the first `length` tokens of the prompt have KV in `kv`."""

    length: int
    kv: KV
    identity: str


@dataclass
class CacheStats:
    """Counters of the prefix cache (exported as metrics and in /hotload/v1/status)."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    dropped: int = 0
    evicted: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionCache(Generic[KV]):
    """LRU of per-session entries bounded by session count and total cached tokens.

    Not thread-safe on purpose: only the scheduler's worker thread touches it.
    """

    def __init__(self, max_sessions: int = 1024, max_tokens: int = 1 << 18) -> None:
        if max_sessions < 0 or max_tokens < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, CacheEntry[KV]] = OrderedDict()
        self._tokens = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Tokens held across all sessions."""
        return self._tokens

    def lookup(self, session: str | None, prompt: Sequence[int]) -> PrefixHit[KV] | None:
        """The reusable prefix for `prompt` in `session`, counting a hit or a miss.

        At most `len(prompt) - 1` tokens are reused: the last prompt token must run through the
        model to give the logits of the first generated token.
        """
        if session is None:
            return None
        entry = self._entries.get(session)
        length = 0 if entry is None else min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        if entry is None or length <= 0:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(session)
        self.stats.hits += 1
        self.stats.reused_tokens += length
        return PrefixHit(length, entry.kv, entry.identity)

    def store(self, session: str, tokens: Sequence[int], kv: KV, identity: str) -> None:
        """Remember `session`'s latest tokens and KV (replacing its previous entry)."""
        self._remove(session)
        if not tokens or len(tokens) > self.max_tokens or self.max_sessions == 0:
            return
        self._entries[session] = CacheEntry(tuple(tokens), kv, identity)
        self._tokens += len(tokens)
        while len(self._entries) > self.max_sessions or self._tokens > self.max_tokens:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self.stats.evicted += 1

    def apply_policy(self, policy: CachePolicy) -> int:
        """Apply a swap's prompt-cache policy; return how many entries were dropped."""
        if policy != "all":
            return 0
        dropped = len(self._entries)
        self._entries.clear()
        self._tokens = 0
        self.stats.dropped += dropped
        return dropped

    def _remove(self, session: str) -> None:
        old = self._entries.pop(session, None)
        if old is not None:
            self._tokens -= len(old.tokens)
