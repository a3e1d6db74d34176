"""/metrics in the Prometheus text format, under vLLM's metric names, types and buckets where vLLM has one (so
dashboards built for vLLM read pegainfer), `pegainfer:` names for the rest. Latencies are observed on the server's
side as tokens arrive, and a choice's phases once it finishes with stop or length (as vLLM, which observes no
client abort); counts, gauges and the tokens of each engine step are read from the scheduler when scraped."""

import bisect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pegainfer.runtime.requests import EngineRequest, TokenOutput
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 80.0]
# vLLM's one list for e2e latency and the queue, prefill, decode and inference phases of a request.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts of a request."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class Histogram:
    buckets: list[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.count += times

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        bounds = [str(float(bound)) for bound in self.buckets]  # le="8.0" for an integer bucket, as vLLM's client
        for bound, count in zip([*bounds, "+Inf"], self.counts):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        return [*out, f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.count}"]


class Metrics:
    def __init__(self, model_name: str, *, max_model_len: int = SchedulerConfig.max_model_len,
                 cache_info: dict[str, object] | None = None) -> None:
        """`max_model_len` bounds the token-count buckets; `cache_info` adds labels to vllm:cache_config_info
        beside those read from the scheduler (block_size, num_gpu_blocks, enable_prefix_caching)."""
        bad = [name for name in cache_info or {} if not LABEL_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"cache_info keys must be Prometheus label names ([a-zA-Z_][a-zA-Z0-9_]*): got {bad[0]!r}")
        self.labels = f'model_name="{model_name}"'
        self.cache_info = {"cache_dtype": "auto", **(cache_info or {})}  # auto: the model's dtype, as vLLM says
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Histogram(buckets_1_2_5(max_model_len))
        self.generation_tokens = Histogram(buckets_1_2_5(max_model_len))
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.startup_seconds: float | None = None  # process start to HTTP ready

    def observe_finished(self, request: EngineRequest, last: TokenOutput, first_token: float, generated: int,
                         reason: str) -> None:
        """A choice that finished with stop or length: arrival to first scheduled (queue), to its first token
        (prefill), to its last (decode; prefill + decode = inference), and its sizes. Preemptions count within."""
        self.finished[reason] += 1
        self.e2e.observe(last.time - request.arrival)
        self.queue.observe(last.first_scheduled - request.arrival)
        self.prefill.observe(first_token - last.first_scheduled)
        self.decode.observe(last.time - first_token)
        self.inference.observe(last.time - last.first_scheduled)
        self.prompt_tokens.observe(len(request.prompt_ids))
        self.generation_tokens.observe(generated)

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
        lines = series_lines(series, self.labels)
        lines += ["# HELP vllm:request_success_total Finished requests by finish reason.",
                  "# TYPE vllm:request_success_total counter"]
        lines += [f'vllm:request_success_total{{{self.labels},finished_reason="{reason}"}} {count}'
                  for reason, count in self.finished.items()]
        if scheduler.host is not None:
            lines += host_tier_lines(scheduler.host, self.labels)
        if scheduler.speculator is not None:
            lines += spec_decode_lines(stats, self.labels, scheduler.speculator.config.num_speculative_tokens)
        lines += ["# HELP vllm:cache_config_info Information of the KV cache's configuration.",
                  "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{self.cache_labels(scheduler)}}} 1"]
        for name, histogram, help_text in (
                ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("vllm:inter_token_latency_seconds", self.itl, "Time between consecutive tokens of a request."),
                ("vllm:e2e_request_latency_seconds", self.e2e, "Request latency, arrival to last token."),
                ("vllm:request_queue_time_seconds", self.queue, "Time waiting, arrival to first scheduled."),
                ("vllm:request_prefill_time_seconds", self.prefill, "Time in prefill, first scheduled to first token."),
                ("vllm:request_decode_time_seconds", self.decode, "Time in decode, first token to last token."),
                ("vllm:request_inference_time_seconds", self.inference,
                 "Time running, first scheduled to last token (preemptions included)."),
                ("vllm:request_prompt_tokens", self.prompt_tokens, "Prompt tokens of a finished request."),
                ("vllm:request_generation_tokens", self.generation_tokens, "Generated tokens of a finished request."),
                ("vllm:iteration_tokens_total", step_histogram(scheduler), "Tokens run by an engine step.")):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *histogram.lines(name, self.labels)]
        return "\n".join(lines) + "\n"

    def cache_labels(self, scheduler: Scheduler) -> str:
        """vLLM's CacheConfig fields as labels, str() of each value as vLLM writes them; the scheduler's facts win."""
        allocator = scheduler.allocator
        info = {**self.cache_info, "block_size": allocator.block_size, "num_gpu_blocks": allocator.num_blocks,
                "enable_prefix_caching": scheduler.cache is not None}
        return ",".join(f'{name}="{escape(str(value))}"' for name, value in sorted(info.items()))


def series_lines(series, labels: str) -> list[str]:
    """Prometheus text of (name, kind, help, value) series, one sample each under the server's labels."""
    lines = []
    for name, kind, help_text, value in series:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
    return lines


def host_tier_lines(host, labels: str) -> list[str]:
    """The host KV tier (runtime/host_tier.py): its size and use, blocks copied down and back, tokens it served."""
    return series_lines((
        ("pegainfer:host_kv_blocks_total", "gauge", "Blocks of the host KV tier.", host.capacity),
        ("pegainfer:host_kv_blocks_used", "gauge", "Host blocks holding an evicted cached block.", host.used),
        ("pegainfer:host_kv_offloaded_blocks_total", "counter", "Cached blocks copied down to the host.",
         host.offloaded),
        ("pegainfer:host_kv_restored_blocks_total", "counter", "Host blocks copied back on a prefix hit.",
         host.restored),
        ("pegainfer:host_kv_hit_tokens_total", "counter", "Prompt tokens served from host blocks.", host.hits),
        ("pegainfer:host_kv_restore_seconds_total", "counter", "Time copying host blocks back.",
         round(host.restore_seconds, 6))), labels)


def spec_decode_lines(stats, labels: str, positions: int) -> list[str]:
    """Speculative decoding's counters as vLLM names them: drafts verified (a sequence's in a step), draft tokens
    proposed and accepted, and accepted by draft position."""
    lines = series_lines((
        ("vllm:spec_decode_num_drafts", "counter", "Drafts verified: a sequence's draft tokens checked in a step.",
         stats.spec_drafts),
        ("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.", stats.spec_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.", stats.spec_accepted_tokens)),
        labels)
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [f"# HELP {name} Draft tokens accepted, by their position in the draft.", f"# TYPE {name} counter"]
    by_position = dict(stats.spec_accepted_by_position)
    lines += [f'{name}{{{labels},position="{position}"}} {by_position.get(position, 0)}'
              for position in range(positions)]
    return lines


def step_histogram(scheduler: Scheduler) -> Histogram:
    """The scheduler counts steps by exact token count (as many keys as distinct step sizes, at most the token
    budget); they are bucketed here. dict() copies them in one call, safe against the engine thread's updates."""
    histogram = Histogram(ITERATION_TOKEN_BUCKETS)
    for tokens, steps in dict(scheduler.stats.step_tokens).items():
        histogram.observe(tokens, steps)
    return histogram


def escape(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def resident_bytes() -> int:
    """The process's resident set, from /proc (0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
