"""The hotload operator: `kopf run -m hotload_operator` (or `python -m hotload_operator`).

Importing the package registers the kopf handlers (`handlers.py`, the only module that uses
kopf decorators); everything they decide lives in pure modules (`builders`, `admission`,
`rollup`, `conditions`) that take and return plain data.
"""

from hotload._extras import needs_extra

# kopf comes with the 'operator' extra only.
with needs_extra("operator", "the hotload operator (hotload_operator)"):
    from hotload_operator import handlers  # noqa: F401  (kopf registers handlers on import)
