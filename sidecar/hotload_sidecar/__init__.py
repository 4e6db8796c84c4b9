"""The loader sidecar: follow the ledger, fetch, reconstruct, verify, hot-load, report."""
