"""The server's Prometheus metrics (vLLM's names under `nanovllm:`), in a registry of its own so
that several servers in one process do not collide."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: from tens of milliseconds (a GPU's first token) to minutes (a long queue on a CPU).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Gauges set from the engine's message after each step; counters and histograms as requests
    and tokens come."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def make(kind, name, doc, **kwargs):
            return kind(f"nanovllm:{name}", doc, list(labels), registry=registry,
                        **kwargs).labels(**labels)

        self.running = make(Gauge, "num_requests_running", "Sequences in the running batch.")
        self.waiting = make(Gauge, "num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage = make(Gauge, "kv_cache_usage_perc",
                                   "Fraction of the KV-cache blocks in use (1 = full).")
        self.requests = make(Counter, "requests", "HTTP requests queued in the engine.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of queued requests.")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.")
        self.ttft = make(Histogram, "time_to_first_token_seconds",
                         "Seconds from a request's arrival to its first token.",
                         buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds",
                        "Seconds between a choice's consecutive tokens.", buckets=ITL_BUCKETS)

    def observe_engine(self, num_running: int, num_waiting: int, kv_cache_usage: float):
        """The scheduler's queues and the KV pool's use after the engine's last step."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def observe_request(self, num_prompt_tokens: int):
        self.requests.inc()
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, seconds: float, first: bool):
        """`num_tokens` new tokens of one choice, `seconds` after its arrival (first) or its last
        token: the first is time to first token, the others share the interval."""
        self.generation_tokens.inc(num_tokens)
        if first:
            self.ttft.observe(seconds)
            return
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
