"""The hotload operator: `kopf run -m hotload_operator` (or `python -m hotload_operator`).

Importing the package registers the kopf handlers (`handlers.py`, the only module that uses
kopf decorators); everything they decide lives in pure modules (`builders`, `admission`,
`rollup`, `conditions`) that take and return plain data.
"""

from hotload_operator import handlers  # noqa: F401  (kopf registers handlers on import)
