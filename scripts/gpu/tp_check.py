"""Tensor parallelism on two GPUs: two processes, one GPU and one rank each, joined by NCCL (runtime/gpu/nccl.py).
First each rank's communicator alone (an all-reduce and an all-gather of known values, eagerly and from a captured
CUDA graph); then the engines: rank 0's GpuEngine hands every step to rank 1 (on_step -> execute over a pipe), and
its logits of a small random Qwen3 (an odd vocabulary, so the gathered logits carry padding) are compared with the
CPU reference and with one GPU's engine: a prefill, teacher-forced decode steps through CUDA graphs, the same
eagerly, and tokens drawn on the device; last `pegainfer generate` on two ranks against one. Prints every number (also in $OUT/tp_results.json), then PASS or FAIL
for each check against BOUNDS.

On this (CPU) machine, once:  .venv/bin/python scripts/gpu/tp_check.py prepare
  (the checkpoint in .gpu/tp_small, its TP 1 and TP 2 manifests in .gpu/cache_tp, the nccl4py wheel for the GPU
  machine's Python 3.12 in .whl/, all git-ignored: 23 MB to carry)
On a machine of two GPUs (nvidia-h100-x2), one call, carrying [".gpu/tp_small", ".gpu/cache_tp", ".whl"]:
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nccl4py-*.whl && . scripts/gpu/env.sh &&
  PYTHONPATH=/tmp/site:$PYTHONPATH PEGAINFER_CACHE=$PWD/.gpu/cache_tp python3 scripts/gpu/tp_check.py run
(the image's nvidia-nccl-cu13, cuda-core and cuda-pathfinder serve nccl4py; it keeps NCCL_NVLS_ENABLE=0).
"""

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

WORLD = 2
SHAPE = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1001}
BOUNDS = {"rel_err_vs_cpu": 0.03, "argmax_agreement": 0.97}  # bf16 on both sides; NCCL sums in bf16


def prepare(python: str) -> None:
    """The checkpoint, both layouts' manifests (Triton: the small model's GEMMs are below TileLang's tiles) and the
    nccl4py wheel."""
    def run(*args: str) -> None:
        print("+", " ".join(args), flush=True)
        subprocess.run(args, check=True)
    sets = [f"--set={key}={value}" for key, value in SHAPE.items()]
    run(python, "-m", "pegainfer.cli", "make-checkpoint", ".gpu/tp_small", "--dtype", "bfloat16", "--seed", "3", *sets)
    for tp in ("1", "2"):
        run(python, "-m", "pegainfer.cli", "compile", ".gpu/tp_small", "--sm", "90", "--backends", "triton",
            "--cache-dir", ".gpu/cache_tp", "--tensor-parallel-size", tp)
    shutil.rmtree(".gpu/cache_tp/.triton", ignore_errors=True)  # Triton's own compile cache: not read at runtime
    run(python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", ".whl", "nccl4py==0.6.0")


def check_communicator(engine, results: dict) -> None:
    """All-reduce and all-gather of rank-known values on the engine's stream: eagerly, then from a CUDA graph."""
    from pegainfer.ir.dtypes import dtype_from_name
    from pegainfer.runtime.cuda import driver

    comm, stream, f32 = engine.communicator, engine.ctx.stream, dtype_from_name("f32")
    count = 1000
    source, gathered = driver.alloc(count * 4), driver.alloc(count * 4 * WORLD)
    total = driver.alloc(count * 4)
    mine = np.arange(count, dtype=np.float32) * (comm.rank + 1)
    driver.copy_to_device(source, mine, stream)

    def collectives() -> None:
        comm.all_reduce(source, total, count, f32, stream)
        comm.all_gather(source, gathered, count, f32, stream)
    for mode in ("eager", "graph"):
        if mode == "eager":
            collectives()
        else:
            with driver.Graph(stream) as graph:
                collectives()
            graph.replay()
        engine.ctx.synchronize()
        summed, parts = np.empty(count, np.float32), np.empty(count * WORLD, np.float32)
        driver.copy_to_host(summed, total, stream)
        driver.copy_to_host(parts, gathered, stream)
        engine.ctx.synchronize()
        base = np.arange(count, dtype=np.float32)
        results[f"rank{comm.rank}_all_reduce_{mode}_ok"] = bool(np.array_equal(summed, base * 3))
        results[f"rank{comm.rank}_all_gather_{mode}_ok"] = bool(np.array_equal(parts, np.concatenate([base, base * 2])))


def rank_engine(folder: Path, rank: int, unique_id: bytes, on_step=None):
    from dataclasses import replace

    from check import SMALL

    from pegainfer.frontends.load import load_model
    from pegainfer.passes.shard import Parallelism
    from pegainfer.runtime.gpu.nccl import Rendezvous
    from pegainfer.runtime.gpu.start import gpu_engine

    model = load_model(folder, lazy=True, device="cuda", parallel=Parallelism(WORLD, rank))
    return gpu_engine(model, replace(SMALL, device=rank), compile_missing=False,
                      communicator=Rendezvous(unique_id, WORLD, rank), on_step=on_step)


def worker(folder: Path, unique_id: bytes, link, reports) -> None:
    """Rank 1: its engine runs each step rank 0 sends, until told to stop."""
    results: dict = {}
    try:
        engine = rank_engine(folder, 1, unique_id)
        check_communicator(engine, results)
        while True:
            command, payload = link.recv()
            if command == "stop":
                break
            engine.execute(*payload) if command == "execute" else engine.copy_state(*payload)
        engine.ctx.synchronize()
    except BaseException:  # noqa: BLE001  reported with the rest
        results["rank1_error"] = traceback.format_exc(limit=-4)
    reports.put(results)


def driver_rank(folder: Path, unique_id: bytes, link, reports) -> None:
    """Rank 0: the checks, each of its steps forwarded to rank 1 first."""
    import check

    from pegainfer.frontends.load import load_model
    from pegainfer.runtime.batch import Chunk, Sequence
    from pegainfer.runtime.gpu.start import gpu_engine
    from pegainfer.runtime.reference_engine import ReferenceEngine
    from pegainfer.runtime.sampler import SamplingParams

    results: dict = {}
    try:
        engine = rank_engine(folder, 0, unique_id, on_step=lambda step, plan: link.send(("execute", (step, plan))))
        check_communicator(engine, results)
        model = load_model(folder)
        cpu, one_gpu = ReferenceEngine(model, max_tokens=32 * 256), gpu_engine(model, check.SMALL)
        rng = np.random.default_rng(0)
        vocab = model.spec.config.vocab_size
        prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 17, 1, 33)]
        forced = [rng.integers(0, vocab, 12).tolist() for _ in prompts]
        reference, single = (check.teacher_forced(e, prompts, forced) for e in (cpu, one_gpu))
        results["one_gpu_rel_err_vs_cpu"] = max(check.relative_error(s, r) for s, r in zip(single, reference))
        for mode in ("graphs", "eager"):
            engine.options.cuda_graphs = mode == "graphs"
            ours = check.teacher_forced(engine, prompts, forced)
            results[f"tp2_{mode}_rel_err_vs_cpu"] = max(check.relative_error(o, r) for o, r in zip(ours, reference))
            results[f"tp2_{mode}_rel_err_vs_one_gpu"] = max(check.relative_error(o, s) for o, s in zip(ours, single))
            results[f"tp2_{mode}_argmax_agreement"] = float(np.mean([(o.argmax(-1) == r.argmax(-1)).mean()
                                                                     for o, r in zip(ours, reference)]))
        seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
        drawn = engine.sample([Chunk(s, len(s.token_ids)) for s in seqs], [SamplingParams()] * len(seqs),
                              [0] * len(seqs))
        first = cpu.step([Chunk(Sequence(9 + i, list(p)), len(p)) for i, p in enumerate(prompts)])
        results["tp2_greedy_tokens_argmax_agreement"] = float(np.mean(np.array(drawn.tokens) == first.argmax(-1)))
    except BaseException:  # noqa: BLE001  reported with the rest
        results["rank0_error"] = traceback.format_exc(limit=-6)
    finally:
        link.send(("stop", None))
    reports.put(results)


def run(folder: Path, out: Path, deadline_s: float = 420.0) -> None:
    """Both ranks in processes of their own; their reports gathered, written and judged here."""
    import queue
    import time

    from pegainfer.runtime.gpu.nccl import make_unique_id

    out.mkdir(parents=True, exist_ok=True)
    print(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')!r} (pegainfer keeps it 0 unless set)", flush=True)
    unique_id = make_unique_id()
    context = multiprocessing.get_context("spawn")
    steps_0, steps_1 = context.Pipe()
    reports = context.Queue()
    ranks = [context.Process(target=driver_rank, args=(folder, unique_id, steps_0, reports), name="rank-0"),
             context.Process(target=worker, args=(folder, unique_id, steps_1, reports), name="rank-1")]
    for process in ranks:
        process.start()
    results, started = {}, time.monotonic()
    for _ in ranks:
        try:
            results.update(reports.get(timeout=max(1.0, deadline_s - (time.monotonic() - started))))
        except queue.Empty:
            results["timeout"] = f"a rank reported nothing in {deadline_s:.0f} s (one waits in NCCL for the other)"
            break
    for process in ranks:
        process.join(timeout=10)
        if process.exitcode is None:
            process.kill()
    results |= check_generate(folder)
    (out / "tp_results.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, indent=1, default=str))
    verdicts = {key: value for key, value in results.items() if key.endswith("_ok")}
    verdicts |= {key: value < BOUNDS["rel_err_vs_cpu"] for key, value in results.items()
                 if key.endswith("rel_err_vs_cpu") and isinstance(value, float)}
    verdicts |= {key: value >= BOUNDS["argmax_agreement"] for key, value in results.items()
                 if key.endswith("argmax_agreement")}
    print("\n".join(f"{'PASS' if ok else 'FAIL'}  {key}" for key, ok in verdicts.items()))


def check_generate(folder: Path) -> dict:
    """The served path (runtime/sharded_engine.py, runtime/gpu/sharded.py): `pegainfer generate` on two ranks
    against one, greedy; bf16 sums in another order may flip a near tie, so the first tokens are compared."""
    command = [sys.executable, "-m", "pegainfer.cli", "generate", "--model-path", str(folder), "--device", "cuda",
               "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-tokens", "16", "--ignore-eos", "--json"]
    found = {}
    for tp in ("1", "2"):
        done = subprocess.run([*command, "--tensor-parallel-size", tp], capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            return {f"generate_tp{tp}_error": done.stderr.strip().splitlines()[-1:]}
        found[tp] = json.loads(done.stdout)["token_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(found["1"], found["2"])) if a != b), len(found["1"]))
    return {"generate_tp1": found["1"], "generate_tp2": found["2"], "generate_first_8_ok": agree >= 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["prepare", "run"])
    parser.add_argument("--model", type=Path, default=Path(".gpu/tp_small"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = parser.parse_args()
    if args.what == "prepare":
        prepare(sys.executable)
    else:
        run(args.model, args.out)


if __name__ == "__main__":
    main()
