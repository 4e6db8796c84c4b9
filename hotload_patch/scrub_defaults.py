"""The scrub's defaults, without torch: the processes that configure an engine (`hotload serve`'s
options, the loader) read them where torch is not installed."""

from __future__ import annotations

from typing import Final

#: The most bytes per second a scrub reads when nobody says otherwise: a pass over 140 GB (a
#: 70B model in bfloat16, over all ranks) takes under 40 min; on a CPU about a twentieth of one
#: core while it reads.
DEFAULT_SCRUB_RATE: Final = 64 << 20
#: Seconds from one pass's start to the next's when nobody says otherwise: rot in the served
#: weights is found within about an hour, and a small model costs one short read an hour
#: (the old constant rate re-read a 168 MiB model every 2.6 s, ~20% of a core forever).
DEFAULT_SCRUB_PERIOD: Final = 3600.0
