"""Manifest launches run from torch tensors through the runtime's launch path (runtime/gpu/launch.py: TMA
descriptors, CuTe tensor structs) and timed as the GPU sees them: CUDA graphs of repeats (packing the arguments in
Python never starves the GPU), cuBLAS through torch beside them, the copy bandwidth, and the SM clock and board power
of a sustained run. What kernels.py and the lab's probes share."""

import subprocess
import time
from datetime import datetime
from pathlib import Path

import torch

from pegainfer.backends.manifest import Kernel, Launch, Manifest
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.launch import launch_kernel, load_function

L2_DEFEAT_BYTES = 256 << 20  # weight copies cycled through by the decode timings (the H200's L2 holds 50 MB)


class Runner:
    def __init__(self, folder: Path, manifest: Manifest, pdl: bool = False) -> None:
        """`folder`: where the launches' cubin paths start (a cache root, or a probe's folder)."""
        torch.cuda.init()
        self.pdl = pdl  # programmatic dependent launch for the kernels compiled for it, as decode steps have
        self.ctx = driver.Context.create()
        self.folder = folder
        self.manifest = manifest
        self.functions: dict[str, object] = {}

    def kernel(self, graph: str, node: str) -> Kernel:
        return next(k for k in self.manifest.kernels if (k.graph, k.node) == (graph, node))

    def run(self, launches: list[Launch], env: dict[str, torch.Tensor], sizes: dict[str, int]) -> None:
        tensors = {}
        for name, t in env.items():
            dtype = dtype_from_name({torch.bfloat16: "bf16", torch.float32: "f32", torch.int32: "i32",
                                     torch.int64: "i64", torch.float8_e4m3fn: "f8e4m3"}[t.dtype])
            tensors[name] = DeviceTensor(t.data_ptr(), tuple(t.shape), dtype, t.stride(0) if t.dim() > 1 else 1)
        for launch in launches:
            if launch.key not in self.functions:
                cubin = (self.folder / launch.cubin).read_bytes()
                self.functions[launch.key] = load_function(cubin, launch)[1]
            launch_kernel(self.functions[launch.key], launch, tensors, sizes, self.ctx.stream,
                          pdl=self.pdl and launch.pdl)

    def replayer(self, launches, env: dict | list[dict], sizes, repeats: int = 20):
        """A callable replaying a CUDA graph of `repeats` runs (warmed up once), cycling through `env` when it is a
        list (weight copies that defeat the L2); eager runs, back to back, should the capture fail."""
        envs = env if isinstance(env, list) else [env]
        torch.cuda.synchronize()
        self.run(launches, envs[0], sizes)
        self.ctx.synchronize()
        try:
            with driver.Graph(self.ctx.stream) as graph:
                for i in range(repeats):
                    self.run(launches, envs[i % len(envs)], sizes)
            replay = graph.replay
            replay()
        except driver.CudaError as error:
            print(f"graph capture failed ({error}); timing eagerly", flush=True)
            replay = lambda: [self.run(launches, envs[i % len(envs)], sizes) for i in range(repeats)]  # noqa: E731
        return replay

    def time_us(self, launches, env: dict | list[dict], sizes, repeats: int = 20, rounds: int = 3) -> float:
        """Microseconds per run, from the fastest of `rounds` replays of `replayer`'s graph (a single replay of a
        chain of 5-us kernels is a sample of ~100 us, at the mercy of one clock dip)."""
        replay = self.replayer(launches, env, sizes, repeats)
        best = float("inf")
        for _ in range(rounds):
            start, end = driver.Event(), driver.Event()
            start.record(self.ctx.stream)
            replay()
            end.record(self.ctx.stream)
            self.ctx.synchronize()
            best = min(best, end.seconds_since(start) / repeats * 1e6)
        return best

    def sync(self) -> None:
        self.ctx.synchronize()
        torch.cuda.synchronize()


def torch_time_us(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def torch_graph(calls: list, repeats: int = 20) -> "torch.cuda.CUDAGraph":
    """A torch CUDA graph of `repeats` calls cycling through `calls`, each run once first (cuBLAS sets up its
    handle and workspace outside the capture), replayed once."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            calls[i % len(calls)]()
    graph.replay()
    return graph


def torch_graph_time_us(calls: list, repeats: int = 20) -> float:
    """Microseconds per call from a replay of `torch_graph`: a GEMM of a few rows takes less time on the GPU than
    torch takes to launch it, so eager timing measures Python."""
    graph = torch_graph(calls, repeats)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (the H200.md ceiling's measure)."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (torch_time_us(lambda: b.copy_(a), 10) / 1e6)


class PowerSampler:
    """nvidia-smi sampling the SM clock, board power and temperature every 50 ms into a CSV while it runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.process = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                                         "--format=csv,noheader,nounits", "-lms", "50"], stdout=path.open("w"))

    def measure(self, replay, sync, seconds: float, flops_per_replay: int) -> dict:
        """TFLOP/s of `replay` run back to back for `seconds`, and the mean clock, power and temperature over
        the window's second half (past the clock's response to the switch of kernel)."""
        replay()
        sync()
        start, count = time.time(), 0
        while time.time() - start < seconds:
            for _ in range(10):
                replay()
            count += 10
            sync()
        end = time.time()
        time.sleep(0.1)  # nvidia-smi's last samples of the window
        samples = [s for s in self.samples() if (start + end) / 2 <= s[0] <= end] or [(0.0,) * 4]
        mhz, watts, celsius = (sum(s[i] for s in samples) / len(samples) for i in (1, 2, 3))
        return {"sustained_tflops": flops_per_replay * count / (end - start) / 1e12, "mhz": mhz, "watts": watts,
                "celsius": celsius, "seconds": end - start}

    def samples(self) -> list[tuple[float, float, float, float]]:
        rows = [line.split(", ") for line in self.path.read_text().splitlines() if line.count(",") == 3]
        return [(datetime.strptime(r[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(r[1]), float(r[2]), float(r[3]))
                for r in rows if "N/A" not in r]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def rms_normed(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (Qwen3RMSNorm) of bf16 rows, the reference GEMM operand: in float32, the normed row
    rounded to bf16 before the weight scales it, the product rounded again."""
    x = x.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    return (normed.float() * g.float()).to(torch.bfloat16)
