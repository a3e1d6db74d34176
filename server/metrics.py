"""/metrics in the Prometheus text format, under vLLM's metric names where vLLM has one (so dashboards built for
vLLM read pegainfer), `pegainfer:` names for the rest. Latencies are observed on the server's side as tokens
arrive; counts and gauges are read from the scheduler when scraped."""

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

from pegainfer.runtime.scheduler import Scheduler

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0]


@dataclass
class Histogram:
    buckets: list[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        return [*out, f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.count}"]


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}"'
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.startup_seconds: float | None = None  # process start to HTTP ready

    def render(self, scheduler: Scheduler, healthy: bool) -> str:
        allocator, cache, stats = scheduler.allocator, scheduler.cache, scheduler.stats
        total = allocator.num_blocks
        evictable = cache.num_evictable if cache else 0
        series = [
            ("vllm:num_requests_running", "gauge", "Requests in the running batch.", len(scheduler.running)),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission (preempted ones included).",
             len(scheduler.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by requests (1 = full).",
             scheduler.blocks_in_use / total),
            ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
             cache.queries if cache else 0),
            ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
             cache.hits if cache else 0),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", stats.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Generated tokens.", stats.generation_tokens),
            ("vllm:num_preemptions_total", "counter", "Sequences preempted to free KV blocks.", stats.preemptions),
            ("pegainfer:prefill_tokens_total", "counter",
             "Prompt tokens computed by prefill chunks (prefix-cache hits skip theirs; recomputes count).",
             stats.prefill_tokens),
            ("pegainfer:engine_steps_total", "counter", "Engine steps run.", stats.steps),
            ("pegainfer:kv_blocks_total", "gauge", "KV blocks in the pool.", total),
            ("pegainfer:kv_blocks_in_use", "gauge", "KV blocks held by requests.", scheduler.blocks_in_use),
            ("pegainfer:kv_blocks_cached", "gauge", "Unreferenced KV blocks kept by the prefix cache.", evictable),
            ("pegainfer:kv_blocks_free", "gauge", "KV blocks on the free list.", allocator.num_free),
            ("pegainfer:engine_healthy", "gauge", "1 while the engine loop runs, 0 once it failed.", int(healthy)),
            ("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", resident_bytes()),
        ]
        if self.startup_seconds is not None:
            series.append(("pegainfer:startup_seconds", "gauge", "Process start to HTTP ready.",
                           round(self.startup_seconds, 3)))
        lines = []
        for name, kind, help_text, value in series:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{self.labels}}} {value}"]
        lines += ["# HELP vllm:request_success_total Finished requests by finish reason.",
                  "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{{self.labels},finished_reason="{reason}"}} {count}'
                  for reason, count in self.finished.items()]
        for name, histogram, help_text in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("vllm:inter_token_latency_seconds", self.itl, "Time between consecutive tokens of a request."),
                ("vllm:e2e_request_latency_seconds", self.e2e, "Request latency, arrival to last token.")):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *histogram.lines(name, self.labels)]
        return "\n".join(lines) + "\n"


def resident_bytes() -> int:
    """The process's resident set, from /proc (0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
