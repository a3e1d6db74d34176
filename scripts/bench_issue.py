"""The host's cost of issuing one eager step, without a GPU: the executor walks a compiled model's manifest (the
4B's, say) and packs every launch's arguments as on the GPU, over a driver whose calls return at once (the TMA
encoder too). What a prefill or mixed step costs the CPU before the GPU has all of its launches.

    python scripts/bench_issue.py .gpu/aot_cache/sm_90/manifests/Qwen3ForCausalLM-*.json [--tokens 2048]"""

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from pegainfer.backends.manifest import load
from pegainfer.frontends.load import load_spec, resolve_config_path
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence, pack_step
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu import executor as executing
from pegainfer.runtime.gpu import launch as launching
from pegainfer.runtime.gpu.executor import GpuExecutor, Limits
from pegainfer.runtime.kv_blocks import BlockAllocator


class StandInEvent:
    """driver.Event without a device: every copy it marks is done at once."""
    def __init__(self, timing: bool = True) -> None:
        pass

    def record(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def stand_in_driver(launches: list[int]) -> None:
    """Device memory as addresses only, launches counted, descriptors of zeros."""
    memory = [0x10000]

    def alloc(nbytes: int) -> int:
        memory.append(memory[-1] + -(-max(nbytes, 1) // 256) * 256)
        return memory[-2]
    for name, stand_in in (("alloc", alloc), ("memset", lambda *a: None), ("copy_to_device", lambda *a: None),
                           ("alloc_pinned", lambda n: np.zeros(n, np.uint8)), ("Event", StandInEvent),
                           ("launch", lambda *a, **k: launches.append(1))):
        setattr(driver, name, stand_in)
    executing.load_function = lambda cubin, launch: (None, launch.symbol)
    executing.upload_weights = lambda graph, weights, stream, arena: {
        name: arena.take(t.dtype.itemsize * int(np.prod(t.shape))) for name, t in graph.expanded_params().items()}
    launching.pack_launch.__defaults__ = (None, lambda descriptor: bytes(128))  # scratch, encode
    executing.GpuExecutor._load_functions = lambda self, folder: {
        launch.key: (None, launch.symbol) for k in self.kernels.values() for v in k.variants for launch in v.launches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens in the step, two prompts")
    parser.add_argument("--decode", type=int, default=62, help="decode rows beside them, at context 1024")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    launches: list[int] = []
    stand_in_driver(launches)
    manifest = load(args.manifest)
    spec = load_spec(resolve_config_path(manifest.config))
    lowered, _ = lower(spec.graph)
    gpu = GpuExecutor(SimpleNamespace(stream=0), lowered, args.manifest, {}, Limits(4096, 256, 256, 0, 16))
    gpu.allocate_kv(8192)
    allocator = BlockAllocator(8192, 16, reserved=1)
    decode = [Sequence(i, [1] * 1100) for i in range(args.decode)]
    for seq in decode:
        allocator.grow(seq.table, 1024)
        seq.num_cached = 1024
    prompts = [Sequence(1000 + i, [1] * (args.tokens // 2)) for i in range(2)]
    chunks = [*(Chunk(s, 1) for s in decode), *(Chunk(s, args.tokens // 2) for s in prompts)]
    times = []
    for _ in range(args.steps):
        launches.clear()
        began = time.perf_counter()
        gpu.run(gpu.upload_step(pack_step(chunks, allocator)))
        times.append(time.perf_counter() - began)
    ms = 1e3 * float(np.median(times))
    print(f"{len(chunks)} sequences, {sum(c.num_tokens for c in chunks)} tokens: {len(launches)} launches issued "
          f"in {ms:.2f} ms ({1e3 * ms / len(launches):.1f} us a launch), median of {args.steps}")


if __name__ == "__main__":
    main()
