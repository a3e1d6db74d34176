"""/metrics of a real app (the reference engine on the tiny checkpoint, in-process): vLLM's request histograms,
the per-step token histogram and cache_config_info, parsed from the Prometheus text and checked against each other,
the responses' usage and the scheduler's counters."""

import asyncio
import re
from collections import defaultdict

import httpx
import pytest

from pegainfer.frontends.load import load_model
from pegainfer.runtime.chat import load_chat_template
from pegainfer.runtime.engine_loop import EngineLoop
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
from pegainfer.runtime.tokenizer import load_tokenizer
from pegainfer.server.app import ServerContext, build_app
from pegainfer.server.metrics import Metrics

NAME = "tiny"
MAX_MODEL_LEN = 256
PHASES = ["vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
          "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"]
PER_REQUEST = [*PHASES, "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
               "vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"]
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Scrape:
    """A parsed Prometheus text: each # TYPE, and each sample as (labels, value) under its series name."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                name, kind = line[len("# TYPE "):].split(" ")
                assert name not in self.types, f"{name} is typed twice"
                self.types[name] = kind
            elif line and not line.startswith("#"):
                match = SAMPLE.match(line)
                assert match, f"not a Prometheus sample line: {line!r}"
                name, labels, value = match.groups()
                self.samples[name].append((dict(LABEL.findall(labels or "")), float(value)))

    def value(self, name: str) -> float:
        (only,) = self.samples[name]
        return only[1]

    def histogram(self, name: str) -> tuple[list[tuple[float, float]], float, float]:
        """Its buckets as (le, cumulative count), its _sum and its _count."""
        buckets = [(float(labels["le"]), value) for labels, value in self.samples[f"{name}_bucket"]]
        return buckets, self.value(f"{name}_sum"), self.value(f"{name}_count")


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    """Runs four completions (one with n=2) at once through the app; the /metrics text after, and their usage."""
    tokenizer = load_tokenizer(tiny_checkpoint)
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(ReferenceEngine(load_model(tiny_checkpoint), max_tokens=1024), tokenizer.eos_token_ids,
                          config)
    loop = EngineLoop(scheduler).start()
    metrics = Metrics(NAME, max_model_len=MAX_MODEL_LEN, cache_info={"gpu_memory_utilization": 0.9})
    ctx = ServerContext(engine=loop, tokenizer=tokenizer, chat_template=load_chat_template(tiny_checkpoint),
                        model_name=NAME, model_root=str(tiny_checkpoint), max_model_len=MAX_MODEL_LEN,
                        vocab_size=512, metrics=metrics)
    bodies = [{"prompt": list(range(3, 3 + length)), "max_tokens": max_tokens, "n": n, "temperature": 0,
               "ignore_eos": True} for length, max_tokens, n in [(5, 4, 1), (30, 7, 2), (12, 1, 1), (21, 9, 1)]]

    async def scenario() -> tuple[list[dict], str]:
        transport = httpx.ASGITransport(app=build_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://pegainfer", timeout=120) as client:
            responses = await asyncio.gather(*[client.post("/v1/completions", json=body) for body in bodies])
            assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
            return [{**r.json()["usage"], "n": body["n"]} for r, body in zip(responses, bodies)], \
                (await client.get("/metrics")).text
    try:
        usages, text = asyncio.run(scenario())
    finally:
        loop.stop()
    return Scrape(text), usages, scheduler


def test_each_new_name_has_vllms_type(served):
    scrape, _, _ = served
    for name in [*PER_REQUEST, "vllm:iteration_tokens_total"]:
        assert scrape.types.get(name) == "histogram", (name, scrape.types.get(name))
    assert scrape.types["vllm:cache_config_info"] == "gauge"


def test_histogram_buckets_are_cumulative_and_end_with_inf_equal_to_count(served):
    scrape, _, _ = served
    for name in [*PER_REQUEST, "vllm:iteration_tokens_total"]:
        buckets, _, count = scrape.histogram(name)
        bounds, counts = [le for le, _ in buckets], [c for _, c in buckets]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds) and bounds[-1] == float("inf"), name
        assert counts == sorted(counts) and counts[-1] == count, (name, buckets, count)
    # token counts of a request: vLLM's 1-2-5 buckets up to max_model_len
    assert [le for le, _ in scrape.histogram("vllm:request_prompt_tokens")[0]][:-1] == \
        [1, 2, 5, 10, 20, 50, 100, 200]


def test_per_request_histograms_count_every_finished_choice_and_its_tokens(served):
    scrape, usages, _ = served
    choices = sum(u["n"] for u in usages)
    finished = sum(value for labels, value in scrape.samples["vllm:request_success_total"]
                   if labels["finished_reason"] in ("stop", "length"))
    assert finished == choices
    for name in PER_REQUEST:
        assert scrape.histogram(name)[2] == choices, name
    generated = sum(u["completion_tokens"] for u in usages)
    assert scrape.histogram("vllm:request_generation_tokens")[1] == generated
    assert scrape.value("vllm:generation_tokens_total") == generated
    # usage counts a prompt once for its n choices; the histogram once per choice
    assert scrape.histogram("vllm:request_prompt_tokens")[1] == sum(u["prompt_tokens"] * u["n"] for u in usages)


def test_the_phases_of_a_request_add_up(served):
    scrape, _, _ = served
    queue, prefill, decode, inference = (scrape.histogram(name)[1] for name in PHASES)
    assert min(queue, prefill, decode, inference) >= 0
    assert prefill + decode == pytest.approx(inference, rel=1e-9, abs=1e-9)
    assert queue + inference == pytest.approx(scrape.histogram("vllm:e2e_request_latency_seconds")[1], abs=1e-9)
    assert queue + prefill == pytest.approx(scrape.histogram("vllm:time_to_first_token_seconds")[1], abs=1e-9)


def test_iteration_tokens_add_up_to_the_tokens_the_engine_stepped(served):
    scrape, _, _ = served
    buckets, total, steps = scrape.histogram("vllm:iteration_tokens_total")
    assert steps == scrape.value("pegainfer:engine_steps_total") > 0
    assert scrape.value("vllm:num_preemptions_total") == 0
    # every choice's first token came from its last prompt chunk; each later token was one decode token
    choices = scrape.histogram("vllm:request_generation_tokens")[2]
    assert total == scrape.value("pegainfer:prefill_tokens_total") + scrape.value("vllm:generation_tokens_total") \
        - choices
    assert dict(buckets)[16.0] == steps  # the step budget: no step ran more than 16 tokens
    assert dict(buckets)[8.0] < steps  # chunked prefill filled some steps past 8


def test_cache_config_info_labels_come_from_the_scheduler_and_the_caller(served):
    scrape, _, scheduler = served
    ((labels, value),) = scrape.samples["vllm:cache_config_info"]
    assert value == 1
    assert labels == {"block_size": str(scheduler.allocator.block_size),
                      "num_gpu_blocks": str(int(scrape.value("pegainfer:kv_blocks_total"))),
                      "enable_prefix_caching": "True", "cache_dtype": "auto", "gpu_memory_utilization": "0.9"}


def test_metrics_refuses_a_cache_label_that_prometheus_cannot_name():
    with pytest.raises(ValueError, match="label names .* got 'gpu-memory'"):
        Metrics(NAME, cache_info={"gpu-memory": 0.9})
