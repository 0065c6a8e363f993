"""The replicas' Prometheus metrics as one: every sample summed over the replicas, label set by
label set (counters, gauges of slots and queues, histogram buckets, sums and counts alike)."""

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def summed_metrics(texts: list[str]) -> bytes:
    """Prometheus text of the sum of `texts` (each a replica's /metrics). `_created` samples,
    timestamps rather than amounts, are left out."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # a family of its own where the parser meets its TYPE line
                continue
            families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            sums = totals.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sample.labels.items()))
                sums[key] = sums.get(key, 0.0) + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in totals[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return generate_latest(_Families(list(families.values())))
