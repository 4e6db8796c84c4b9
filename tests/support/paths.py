"""Where the repository is: every path a test reads (charts, docs, examples) starts here."""

from __future__ import annotations

from pathlib import Path

#: The repository's root folder.
REPO = Path(__file__).resolve().parents[2]
