"""`python -m hotload` runs the CLI."""

from hotload.cli.main import main

main()
