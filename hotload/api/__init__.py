"""The hotload API: CRD models (the single source of truth for `crds/`) and shared names."""
