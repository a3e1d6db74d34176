"""A model sharded over processes on the CPU engine: worker ranks started by multiprocessing and as Ray actors of
a local Ray cluster give the greedy tokens of one process; a worker killed mid-run fails the engine and its
requests within seconds (health 503), and `pegainfer serve --tensor-parallel-size 2` does all of this over HTTP."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from live_server import NAME, start_server
from pegainfer.errors import ConfigError
from pegainfer.frontends.load import load_model
from pegainfer.runtime.detokenize import decode_completion
from pegainfer.runtime.offline import Request, generate
from pegainfer.runtime.rank_links import RankFailed
from pegainfer.runtime.rank_workers import RankSpec
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.sharded_engine import start_sharded_engine
from pegainfer.runtime.tokenizer import load_tokenizer

KV_TOKENS = 512
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(30, 60))]


def requests(max_tokens: int = 12, logprobs: int | None = 2) -> list[Request]:
    return [Request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True))
            for ids in PROMPTS]


def one_process(folder, max_tokens: int = 12) -> list:
    return generate(ReferenceEngine(load_model(folder), max_tokens=KV_TOKENS), requests(max_tokens), [])


def assert_same_completions(ours: list, theirs: list) -> None:
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        for mine, reference in zip(a.logprobs, b.logprobs):
            assert mine.keys() == reference.keys()
            np.testing.assert_allclose(list(mine.values()), list(reference.values()), atol=1e-4)


@pytest.mark.parametrize("name, world", [("tiny_tied", 2), ("qwen3_moe_topk", 2), ("qwen3_5_hybrid", 2)])
def test_processes_generate_what_one_process_does(checkpoint_factory, name, world):
    folder = checkpoint_factory(name)
    engine = start_sharded_engine(RankSpec(str(folder), world, kv_tokens=KV_TOKENS, max_seqs=4))
    try:
        assert_same_completions(generate(engine, requests(), []), one_process(folder))
    finally:
        engine.shutdown()


def test_a_worker_killed_mid_run_fails_the_engine_within_seconds(tiny_checkpoint):
    engine = start_sharded_engine(RankSpec(str(tiny_checkpoint), 2, kv_tokens=KV_TOKENS, max_seqs=4))
    failures = []
    engine.watch(failures.append)
    try:
        generate(engine, requests(2), [])
        (pid,) = engine.ranks.pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "exit code -9" in str(failures[0])
        with pytest.raises(RankFailed, match="worker rank exited"):
            generate(engine, requests(2), [])
    finally:
        engine.shutdown()


def test_a_worker_that_cannot_load_fails_the_start_in_one_line(checkpoint_factory):
    """Heads the ranks cannot split: each rank refuses its graph, the driver's error names the tensor."""
    with pytest.raises(ConfigError, match=r"q_proj\.weight has 3 heads"):
        start_sharded_engine(RankSpec(str(checkpoint_factory("odd_single_kv")), 2, kv_tokens=KV_TOKENS))


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_actors_generate_what_one_process_does_and_a_killed_actor_fails_the_engine(local_ray,
                                                                                       tiny_checkpoint):
    engine = start_sharded_engine(RankSpec(str(tiny_checkpoint), 2, kv_tokens=KV_TOKENS, max_seqs=4), "ray")
    failures = []
    engine.watch(failures.append)
    try:
        assert_same_completions(generate(engine, requests(), []), one_process(tiny_checkpoint))
        (pid,) = engine.ranks.pids()
        assert pid != os.getpid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "rank 1's Ray actor" in str(failures[0])
        with pytest.raises(RankFailed):
            generate(engine, requests(2), [])
    finally:
        engine.shutdown()


def test_serve_with_two_ranks_answers_as_one_and_a_killed_worker_turns_health_to_503(tiny_checkpoint, tmp_path):
    server = start_server(tiny_checkpoint, "--tensor-parallel-size", "2", "--kv-cache-tokens", "2048",
                          log=tmp_path / "serve.log")
    try:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = server.post("/v1/completions", body)
        assert answer.status_code == 200, answer.text
        expected = one_process(tiny_checkpoint)[0].token_ids
        text = decode_completion(load_tokenizer(tiny_checkpoint), PROMPTS[0], expected)
        assert answer.json()["choices"][0]["text"] == text
        pid = int(re.search(r"worker pids (\d+)", server.log.read_text()).group(1))
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          headers={"Authorization": "Bearer test-key"},
                          json={**body, "max_tokens": 400, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # generating
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)
        assert any('"error"' in line and "worker rank" in line for line in rest), rest[-3:]
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 5, "health still 200 five seconds after the worker died"
            time.sleep(0.1)
        failed = server.post("/v1/completions", body)
        assert failed.status_code == 503 and "worker rank" in failed.json()["error"]["message"]
    finally:
        server.process.terminate()
        server.process.wait(30)


def test_generate_on_the_command_line_with_two_ranks_prints_what_one_process_does(tiny_checkpoint):
    command = [sys.executable, "-m", "pegainfer.cli", "generate", "--model-path", str(tiny_checkpoint), "--device",
               "cpu", "--prompt-ids", "5,6,7,8", "--max-tokens", "10", "--ignore-eos", "--json"]
    outputs = [subprocess.run(command + extra, capture_output=True, text=True, timeout=120)
               for extra in ([], ["--tensor-parallel-size", "2"])]
    assert all(out.returncode == 0 for out in outputs), outputs[1].stderr
    one, two = (json.loads(out.stdout) for out in outputs)
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 10


def test_a_gpu_worker_repeats_the_drivers_steps_and_takes_the_fewest_blocks(monkeypatch):
    """The GPU workers' side of the links, on a stand-in engine in a thread: it reports its pool when ready, then
    executes each (step, plan) the driver sends, copies states and cuts its pool as told."""
    import threading

    from pegainfer.runtime import rank_workers
    from pegainfer.runtime.rank_links import DriverLinks

    done = []

    class StandIn:
        kv_blocks = 100

        def execute(self, step, plan):
            done.append(("execute", sorted(step), plan))

        def copy_state(self, src, dst):
            done.append(("copy_state", src, dst))

        def limit_kv_blocks(self, blocks):
            done.append(("limit", blocks))
    monkeypatch.setattr(rank_workers, "load_rank_engine", lambda spec, rank: StandIn())
    links = DriverLinks(2)
    worker = threading.Thread(target=rank_workers.serve_rank,
                              args=(RankSpec("unused", 2, device="cuda"), 1, links.address, links.authkey))
    worker.start()
    assert links.accept(lambda: None, 10) == [100]
    links.send_all("execute_plan", ({"input_ids": np.zeros(3, np.int32)}, "bucket-4"))
    links.send_all("copy_state", (3, 7))
    links.send_all("limit_kv_blocks", 80)
    links.send_all("stop")
    worker.join(10)
    links.close()
    assert done == [("execute", ["input_ids"], "bucket-4"), ("copy_state", 3, 7), ("limit", 80)]
