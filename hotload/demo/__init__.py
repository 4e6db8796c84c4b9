"""The local demo and the example trainer it (and the benchmarks) use; needs the `train` extra."""
