"""Start-up of `pegainfer serve` and `pegainfer generate`: the port bound before the model loads and the ready line
printed once it accepts connections; --port and --host errors; max_model_len against the KV pool; --dtype (float16
against transformers in float16); kernels compiled at start where a compiler is installed (on a fake SM 90
device); and Hugging Face ids read from a hub cache laid out as huggingface_hub lays it."""

import contextlib
import hashlib
import io
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers

from pegainfer.backends import build
from pegainfer.backends.cache import manifest_path, model_id
from pegainfer.cli import build_parser, main
from pegainfer.errors import ConfigError, PegainferError
from pegainfer.frontends import kv_cache, load, quantization
from pegainfer.frontends.hub import HUB_FILES, resolve_checkpoint
from pegainfer.runtime import device
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.generate import Request, generate
from pegainfer.runtime.gpu import engine as gpu_engine
from pegainfer.runtime.offline import generate_one
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.server import cli as server_cli

PROMPT = [5, 9, 200, 17]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
FAKE_POOL_TOKENS = 512  # the fake GPU engine's KV pool when it is sized "from memory"


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pegainfer: error: "), err
    return lines[0]


def serve_args(checkpoint, *extra: str):
    return build_parser().parse_args(["serve", "--model-path", str(checkpoint), *extra])


# --- the listening socket ------------------------------------------------------------------------------------------

def test_a_port_in_use_fails_at_once_before_the_model_loads(capsys, tiny_checkpoint, monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was bound")
    monkeypatch.setattr(load, "load_model", loaded)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "--model-path", str(tiny_checkpoint), "--device", "cpu", "--port", str(port)])
    line = one_line_error(capsys.readouterr().err)
    assert code == 1 and f"127.0.0.1:{port}" in line and "already in use" in line


@pytest.mark.parametrize("port", ["99999", "-1", "abc", "65536"])
def test_a_port_out_of_range_is_a_usage_error(capsys, tiny_checkpoint, port):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model-path", str(tiny_checkpoint), "--port", port])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--port: expected a port number in 0..65535, got '{port}'" in err
    assert "Traceback" not in err


def test_a_host_that_does_not_resolve_is_one_line(capsys, tiny_checkpoint):
    code = main(["serve", "--model-path", str(tiny_checkpoint), "--device", "cpu", "--host", "no-such-host.invalid"])
    line = one_line_error(capsys.readouterr().err)
    assert code == 1 and "--host no-such-host.invalid: cannot resolve it" in line


def wait_for_line(log: Path, process: subprocess.Popen, word: str, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lines = [line for line in log.read_text().splitlines() if word in line]
        if lines:
            return lines[0]
        assert process.poll() is None, f"the server exited: {log.read_text()}"
        time.sleep(0.02)
    raise AssertionError(f"no {word!r} line in {seconds} s: {log.read_text()}")


@contextlib.contextmanager
def cpu_server(checkpoint: Path, log: Path, *flags: str):
    """`pegainfer serve --device cpu --port 0 FLAGS` in a process of its own: (its ready line, its URL), the
    process stopped after."""
    command = [sys.executable, "-m", "pegainfer.cli", "serve", "--model-path", str(checkpoint), "--device", "cpu",
               "--port", "0", *flags]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        line = wait_for_line(log, process, "ready")
        yield line, line.split(" on ", 1)[1].split(" ", 1)[0]
    finally:
        process.terminate()
        process.wait(30)


def test_the_ready_line_comes_once_the_port_serves_and_names_the_clamped_max_model_len(tiny_checkpoint, tmp_path):
    """--port 0 takes any free port: the ready line must name the one bound, and answer at once, with no retry.
    Without --max-model-len, config.json's 2048 is clamped to the 1024 tokens the KV cache holds."""
    log = tmp_path / "serve.log"
    with cpu_server(tiny_checkpoint, log, "--kv-cache-tokens", "1024", "--served-model-name", "tiny") as (line, url):
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
    assert "max_model_len 1024 (max_position_embeddings 2048, clamped to the KV cache)" in line
    assert "64 KV blocks of 16 tokens" in line and "dtype float32" in line and "async scheduling on" in line
    assert [m["max_model_len"] for m in models] == [1024]
    assert "Traceback" not in log.read_text(), log.read_text()


def test_no_async_scheduling_serves_with_plain_steps_and_the_same_greedy_completion(tiny_checkpoint, tmp_path):
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
    texts = []
    for flags in ((), ("--no-async-scheduling",)):
        with cpu_server(tiny_checkpoint, tmp_path / "serve.log", "--served-model-name", "tiny", *flags) as (line, url):
            texts.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
        assert f"async scheduling {'off' if flags else 'on'}" in line
    assert texts[0] == texts[1] and texts[0]


def test_an_explicit_max_model_len_past_the_kv_cache_is_refused_before_the_engine(capsys, tiny_checkpoint,
                                                                                  monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("the engine was built although the pool's size was known to be too small")
    monkeypatch.setattr(server_cli, "build_engine", built)
    code = main(["serve", "--model-path", str(tiny_checkpoint), "--device", "cpu", "--port", "0",
                 "--kv-cache-tokens", "1000", "--max-model-len", "2048"])
    line = one_line_error(capsys.readouterr().err)
    assert code == 1 and "--max-model-len 2048" in line and "1008 tokens" in line  # 63 blocks of 16
    assert "--kv-cache-tokens" in line and "--gpu-memory-utilization" in line


# --- --dtype ---------------------------------------------------------------------------------------------------------

def test_the_cli_offers_the_dtypes_and_quantizations_the_frontend_takes():
    assert server_cli.DTYPE_CHOICES == load.DTYPE_CHOICES
    assert server_cli.QUANTIZATION_CHOICES == quantization.QUANTIZATION_CHOICES
    assert server_cli.KV_CACHE_DTYPES == kv_cache.KV_CACHE_DTYPES


def test_an_fp8_kv_cache_is_named_by_the_ready_line_and_the_metrics(tiny_checkpoint, tmp_path):
    """As vLLM's cache_config_info says its cache_dtype; the pool of the same --kv-cache-tokens as bf16's."""
    with cpu_server(tiny_checkpoint, tmp_path / "serve.log", "--kv-cache-tokens", "1024", "--kv-cache-dtype",
                    "fp8") as (line, url):
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    assert "64 KV blocks of 16 tokens in fp8" in line
    info = next(m for m in metrics.splitlines() if m.startswith("vllm:cache_config_info{"))
    assert 'cache_dtype="fp8"' in info
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("requested, checkpoint, on, unstable, expected", [
    ("auto", "float32", "cuda", None, "bfloat16"),  # vLLM: a float32 checkpoint runs in the GPU's preferred bf16
    ("auto", "float32", "cpu", None, "float32"),
    ("auto", "bfloat16", "cuda", None, "bfloat16"),
    ("auto", "torch.float16", "cuda", None, "float16"),
    ("auto", "float16", "cuda", "unstable", "bfloat16"),  # a model declaring float16 unstable
    ("float16", "bfloat16", "cuda", None, "float16"),
    ("float32", "bfloat16", "cpu", None, "float32"),
])
def test_auto_dtype_follows_vllm(requested, checkpoint, on, unstable, expected):
    assert load.serving_dtype(requested, checkpoint, on, unstable) == expected


def test_an_explicit_float16_is_refused_where_the_model_declares_it_unstable():
    with pytest.raises(ConfigError, match="does not run in float16 \\(overflows\\); use bfloat16 or float32"):
        load.serving_dtype("float16", "bfloat16", "cuda", "overflows")


def test_a_dtype_override_gives_the_model_its_own_manifest(tiny_checkpoint):
    config = tiny_checkpoint / "config.json"
    stored = load.load_spec(config)
    same = load.load_spec(config, dtype="float32")
    half = load.load_spec(config, dtype="float16")
    on_gpu = load.load_spec(config, device="cuda")
    assert stored.dtype_override is None and same.dtype_override is None and model_id(same) == model_id(stored)
    assert half.dtype_override == "float16" and on_gpu.dtype_override == "bfloat16"
    assert len({model_id(stored), model_id(half), model_id(on_gpu)}) == 3
    assert {t.dtype.name for t in half.graph.checkpoint_params().values()} == {"f16"}
    assert manifest_path(Path("c"), 90, half) != manifest_path(Path("c"), 90, stored)


# fp16 keeps 11 significant bits, so every stored activation is off by up to 2^-11 = 4.9e-4 of itself. Both sides
# round the same float16 weights but their activations at different points (ours after every op with float32
# math inside, transformers per torch op), so the logits differ by a few dozen such roundings over the two layers:
# 3.2e-3 of the largest logit was measured (transformers' own float16 against its float32: 3.3e-3). 1e-2 leaves a
# 3x margin, while bfloat16 storage (8 bits) lands at 3.1e-2 and fails it.
FP16_TOLERANCE = 1e-2
PROMPT_LENGTHS = (5, 17, 1, 33)


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def prefill_logits(engine: ReferenceEngine, prompts: list[list[int]]) -> np.ndarray:
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    return engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True)


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full forwards, with each step's gap between the top two logits."""
    tokens, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([tokens])).logits[0, -1].float().numpy()
            top = np.sort(row)[-2:]
            gaps.append(float(top[1] - top[0]))
            tokens.append(int(row.argmax()))
    return tokens[len(prompt):], gaps


def test_float16_matches_transformers_in_float16(tiny_checkpoint):
    """A float32 checkpoint served with --dtype float16: weights cast on load, prefill logits and greedy tokens
    against transformers loading the same checkpoint with dtype=torch.float16, on the CPU."""
    ours = load.load_model(tiny_checkpoint, dtype="float16")
    assert {w.dtype for w in ours.weights.values()} == {np.dtype(np.float16)}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager",
                                                               dtype=torch.float16).eval()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, ours.spec.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    logits = prefill_logits(ReferenceEngine(ours, max_tokens=512), prompts)
    with torch.no_grad():
        expected = np.concatenate([theirs(torch.tensor([p])).logits[0].float().numpy() for p in prompts])
    assert relative_error(logits, expected) < FP16_TOLERANCE
    as_stored = prefill_logits(ReferenceEngine(load.load_model(tiny_checkpoint), max_tokens=512), prompts)
    assert relative_error(logits, as_stored) > 10 * 2 ** -24, "float16 storage made no difference: no cast?"

    steps = 16
    completions = generate(ReferenceEngine(ours, max_tokens=1024),
                           [Request(p, SamplingParams(max_tokens=steps, ignore_eos=True)) for p in prompts], [])
    bound = FP16_TOLERANCE * float(np.abs(expected).max())
    for prompt, completion in zip(prompts, completions):
        tokens, gaps = hf_greedy(theirs, prompt, steps)
        split = next((i for i, (a, b) in enumerate(zip(completion.token_ids, tokens)) if a != b), None)
        # past a near-tie (top two within the rounding bound) the two may rightly choose differently
        assert split is None or gaps[split] < bound, (prompt, completion.token_ids, tokens)


# --- kernels compiled at start, on a fake SM 90 device ---------------------------------------------------------

class FakeGpuEngine:
    """Stands in for GpuEngine where there is no GPU: records what it was built with and runs the reference
    engine, so generate and serve go through to their output."""
    built: list[tuple] = []

    def __init__(self, model, manifest: Path, options, communicator=None, on_step=None, lenders=(),
                 kv_of=None) -> None:
        assert communicator is None and on_step is None and not lenders and kv_of is None, "one rank, no head here"
        FakeGpuEngine.built.append((model, manifest, options))
        self._engine = ReferenceEngine(model, max_tokens=options.kv_tokens or FAKE_POOL_TOKENS)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


@contextlib.contextmanager
def fake_sm90():
    """A visible SM 90 device whose engine is FakeGpuEngine; yields the list of build_model's reports."""
    reports = []
    real = build.build_model

    def counted(*args, **kwargs):
        reports.append(real(*args, **kwargs))
        return reports[-1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device, "cuda_device_count", lambda: 1)
        patch.setattr(device, "visible_sm", lambda: 90)
        patch.setattr(gpu_engine, "GpuEngine", FakeGpuEngine)
        patch.setattr(build, "build_model", counted)
        # build_model points TRITON_CACHE_DIR into its cache: set here (to Triton's default) so that it is undone
        patch.setenv("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
        FakeGpuEngine.built = []
        yield reports


@pytest.fixture(scope="module")
def generated_on_sm90(tiny_checkpoint, tmp_path_factory):
    """`generate --device cuda --dtype float16` twice into an empty cache: what each run printed and returned."""
    cache = tmp_path_factory.mktemp("aot_cache")
    runs = []
    with fake_sm90() as reports:
        for _ in range(2):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                result = generate_one(tiny_checkpoint, GREEDY, prompt_ids=PROMPT, device="cuda", dtype="float16",
                                      cache_dir=cache)
            runs.append((result, err.getvalue(), len(reports)))
        built = list(FakeGpuEngine.built)
    return cache, runs, built


@pytest.mark.slow
def test_generate_on_cuda_compiles_missing_kernels_once(generated_on_sm90, tiny_checkpoint):
    cache, runs, built = generated_on_sm90
    (first, first_err, compiles_after_first), (second, second_err, compiles_after_second) = runs
    spec = load.load_spec(tiny_checkpoint / "config.json", dtype="float16")
    manifest = manifest_path(cache, 90, spec)
    assert compiles_after_first == 1 and compiles_after_second == 1, "the second run compiled again"
    assert manifest.is_file() and [path for _, path, _ in built] == [manifest, manifest]
    assert "compiling" in first_err and "pegainfer compile" in first_err and "compiling" not in second_err
    # the float16 graph compiled for sm_90 (Triton takes every kernel; the native templates take bf16 alone)
    record = json.loads(manifest.read_text())
    assert record["sm"] == 90 and record["model_id"] == model_id(spec)
    cubins = [launch["cubin"] for kernel in record["kernels"] for variant in kernel["variants"]
              for launch in variant["launches"]]
    assert cubins and all((cache / "sm_90" / name).is_file() for name in cubins)
    assert first["dtype"] == "float16" and all(model.spec.config.torch_dtype == "float16" for model, _, _ in built)
    on_cpu = generate_one(tiny_checkpoint, GREEDY, prompt_ids=PROMPT, device="cpu", dtype="float16")
    assert first["token_ids"] == second["token_ids"] == on_cpu["token_ids"]


def copy_cubins(source: Path, target: Path) -> None:
    """The cache's compiled entries without its manifests: what is left once the manifest is deleted."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("manifests", ".triton"))


@pytest.mark.slow
def test_serve_compiles_into_its_cache_dir_and_clamps_to_a_memory_sized_pool(generated_on_sm90, tiny_checkpoint,
                                                                             tmp_path):
    cache = tmp_path / "serve_cache"
    copy_cubins(generated_on_sm90[0], cache)
    listener = server_cli.bind_listener("127.0.0.1", 0)
    args = serve_args(tiny_checkpoint, "--cache-dir", str(cache), "--dtype", "float16")
    try:
        with fake_sm90() as reports, contextlib.redirect_stderr(io.StringIO()) as err:
            loop, ctx, ready_line = server_cli.start_serving(args, None, listener)
            loop.stop()
            line = ready_line()
            (model, manifest, options), = FakeGpuEngine.built
            refused = serve_args(tiny_checkpoint, "--cache-dir", str(cache), "--dtype", "float16",
                                 "--max-model-len", "1024")
            with pytest.raises(PegainferError, match="--max-model-len 1024 is more than the KV cache holds "
                                                     "\\(512 tokens"):
                server_cli.start_serving(refused, None, listener)
    finally:
        listener.close()
    assert len(reports) == 1, "the second start found the manifest the first one wrote"
    report = reports[0]
    assert report.built == 0 and report.hits > 0 and "compiling" in err.getvalue()
    assert manifest == manifest_path(cache, 90, model.spec) and manifest.is_file()
    assert options.kv_tokens is None and options.max_model_len == 2048  # sized from memory: the fake's 512 tokens
    assert ctx.max_model_len == FAKE_POOL_TOKENS and "clamped to the KV cache" in line


def test_without_a_compiler_the_missing_kernels_are_named(tiny_checkpoint, tmp_path, monkeypatch):
    from pegainfer.backends.triton import compiler

    def missing() -> str:
        raise ImportError("triton is not installed", name="triton")
    monkeypatch.setattr(compiler, "triton_version", missing)
    with fake_sm90() as reports, pytest.raises(PegainferError) as error:
        generate_one(tiny_checkpoint, GREEDY, prompt_ids=PROMPT, device="cuda", dtype="float16", cache_dir=tmp_path)
    message = str(error.value)
    spec = load.load_spec(tiny_checkpoint / "config.json", dtype="float16")
    assert reports == [] and FakeGpuEngine.built == [] and "\n" not in message
    assert str(manifest_path(tmp_path, 90, spec)) in message
    assert f"run `pegainfer compile {tiny_checkpoint} --sm 90 --dtype float16` first" in message
    assert "compile extra" in message


# --- Hugging Face ids ------------------------------------------------------------------------------------------------

REPO = "testorg/tiny"


@pytest.fixture
def hub_cache(tiny_checkpoint, tmp_path, monkeypatch) -> Path:
    """The tiny checkpoint as huggingface_hub caches a download: blobs named by hash, a snapshot of links to them
    and refs/main naming the snapshot; HF_HUB_OFFLINE set, so nothing is fetched."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    commit = hashlib.sha1(b"tiny").hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in tiny_checkpoint.iterdir():
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_reads_the_cached_snapshot(hub_cache, tiny_checkpoint):
    checkpoint = resolve_checkpoint(REPO)
    assert checkpoint.repo_id == REPO and checkpoint.name == REPO
    commit = (hub_cache / "models--testorg--tiny" / "refs" / "main").read_text()
    assert checkpoint.folder == (hub_cache / "models--testorg--tiny" / "snapshots" / commit).resolve()
    by_id = generate_one(REPO, GREEDY, prompt_ids=PROMPT, device="cpu")
    by_folder = generate_one(tiny_checkpoint, GREEDY, prompt_ids=PROMPT, device="cpu")
    assert by_id["token_ids"] == by_folder["token_ids"]


def test_serve_names_a_hub_model_by_its_id(hub_cache):
    listener = server_cli.bind_listener("127.0.0.1", 0)
    try:
        loop, ctx, _ = server_cli.start_serving(serve_args(REPO, "--device", "cpu"), None, listener)
        loop.stop()
        loop2, renamed, _ = server_cli.start_serving(serve_args(REPO, "--device", "cpu", "--served-model-name",
                                                                "mine"), None, listener)
        loop2.stop()
    finally:
        listener.close()
    assert (ctx.model_name, ctx.model_root) == (REPO, REPO)
    assert renamed.model_name == "mine"


def test_an_uncached_hub_id_offline_is_one_line(capsys, hub_cache):
    code = main(["generate", "--model-path", "testorg/absent", "--prompt-ids", "1,2", "--device", "cpu"])
    line = one_line_error(capsys.readouterr().err)
    assert code == 1 and f"not in the Hugging Face cache at {hub_cache / 'models--testorg--absent'}" in line
    assert "HF_HUB_OFFLINE is set" in line


def test_a_folder_that_reads_like_an_id_is_a_folder(hub_cache, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_checkpoint, tmp_path / REPO)
    assert resolve_checkpoint(REPO).repo_id is None and resolve_checkpoint(REPO).folder == Path(REPO)


def test_the_hub_download_is_limited_to_what_pegainfer_reads(tiny_checkpoint):
    from huggingface_hub.utils import filter_repo_objects

    read = sorted(file.name for file in tiny_checkpoint.iterdir())
    sharded = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    unread = ["pytorch_model.bin", "README.md", "original/consolidated.00.pth", "vocab.json", ".gitattributes"]
    kept = list(filter_repo_objects(items=read + sharded + unread, allow_patterns=HUB_FILES))
    assert kept == read + sharded
