"""The server's Prometheus metrics, on a registry of its own (GET /metrics)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from well under a decode step to a long queue wait.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.queue_depth = Gauge("qrt_queue_depth", "Requests waiting for a KV-cache slot", registry=registry)
        self.active_slots = Gauge("qrt_active_slots", "KV-cache slots holding a request", registry=registry)
        self.slots = Gauge("qrt_slots", "KV-cache slots (--max-batch)", registry=registry)
        self.time_to_first_token = Histogram(
            "qrt_time_to_first_token_seconds", "From a request reaching the engine to its first token",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "qrt_inter_token_latency_seconds", "Between consecutive tokens of one request",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.step_seconds = Histogram("qrt_engine_step_seconds", "One engine step (prefill chunks and a decode)",
                                      buckets=_LATENCY_BUCKETS, registry=registry)
        self.generated_tokens = Counter("qrt_generated_tokens", "Tokens generated", registry=registry)
        self.prompt_tokens = Counter("qrt_prompt_tokens", "Prompt tokens accepted", registry=registry)
        self.prefix_reused_tokens = Counter(
            "qrt_prefix_cache_reused_tokens", "Prompt tokens not prefilled: whole prefill chunks a free KV-cache "
            "slot held from an earlier request", registry=registry)
        self.speculative_proposed = Counter(
            "qrt_speculative_proposed_tokens", "Guessed tokens checked by speculative decoding", registry=registry)
        self.speculative_accepted = Counter(
            "qrt_speculative_accepted_tokens", "Guessed tokens kept: the model agreed with them", registry=registry)
        self.speculative_checks = Counter(
            "qrt_speculative_checks", "Verify calls: decode steps that checked guesses", registry=registry)
        self.compiled_graphs = Gauge(
            "qrt_compiled_graphs", "Graphs Dynamo compiled in this process (graphs loaded from the compile cache "
            "not counted): a rise after start-up is a recompile", registry=registry)
        self.requests = Counter("qrt_requests", "Requests by outcome: stop, length, cancelled, error (inside the "
                                "engine), rejected (refused before it)", ["outcome"], registry=registry)

    def watch(self, loop) -> None:
        """Read the queue and slot gauges from the engine loop whenever they are scraped."""
        self.queue_depth.set_function(loop.queue_depth)
        self.active_slots.set_function(loop.active_slots)
        self.compiled_graphs.set_function(loop.compiled_graphs)

    def count_speculation(self, now: tuple[int, int, int], before: tuple[int, int, int]) -> None:
        """Add what a step's speculation did: (proposed, accepted, checks) now and before it."""
        for counter, new, old in zip((self.speculative_proposed, self.speculative_accepted, self.speculative_checks),
                                     now, before):
            counter.inc(new - old)

    def render(self) -> bytes:
        return generate_latest(self.registry)
