"""hotload: keep a fleet of inference replicas on the freshest policy."""

__version__ = "0.1.0"
