"""`python -m hotload` runs the CLI."""

from hotload.cli.main import console

console()
