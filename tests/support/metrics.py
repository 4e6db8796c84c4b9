"""Reading metrics in tests: one sample of Prometheus text as a process serves it, and every
sample of a loader's registry, by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from hotload_sidecar.metrics import LoaderMetrics


def metric(text: str, sample: str) -> float:
    """The value of one sample (name plus labels, as exposed) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} is not in the metrics:\n{text}")


def scraped(metrics: LoaderMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape of `metrics`, by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
