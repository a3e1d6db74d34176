"""`pegainfer compile`: lower a model, plan every kernel, compile each launch for each SM in parallel processes
(or take it from the cache), and write one manifest per SM that the runtime reads without any compiler."""

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pegainfer.backends.cache import cache_root, launch_key, manifest_path, model_id, read_entry, sm_folder, write_entry
from pegainfer.backends.spec import KernelSpec, LaunchSpec
from pegainfer.backends.triton.compiler import compile_launch, triton_version
from pegainfer.backends.triton.plan import PlanOptions, plan_kernel
from pegainfer.errors import PegainferError
from pegainfer.frontends.load import ModelSpec
from pegainfer.ir.graph import KERNEL, Graph
from pegainfer.ir.printer import format_node
from pegainfer.passes.pipeline import lower
from pegainfer.progress import Progress

SUPPORTED_SMS = (80, 86, 89, 90, 100, 120)


@dataclass
class BuildReport:
    sms: list[int]
    kernels: int
    launches: int  # per SM, variants counted
    built: int = 0
    hits: int = 0
    seconds: float = 0.0
    cache: Path = Path()
    manifests: list[Path] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.kernels} kernels, {self.launches} launches per SM over their variants, "
                f"{self.built + self.hits} distinct cubins for sm_{', sm_'.join(map(str, self.sms))}: "
                f"{self.built} compiled, {self.hits} cache hits, in {self.seconds:.1f} s; cache {self.cache}")


def parse_sms(text: str) -> list[int]:
    try:
        sms = [int(part) for part in text.replace("sm_", "").split(",") if part.strip()]
    except ValueError:
        raise PegainferError(f"--sm {text}: expected comma-separated compute capabilities such as 80,90") from None
    unknown = [sm for sm in sms if sm not in SUPPORTED_SMS]
    if not sms or unknown:
        raise PegainferError(f"--sm {text}: supported are {', '.join(map(str, SUPPORTED_SMS))}")
    return sms


def plan_model(spec: ModelSpec, options: PlanOptions) -> tuple[Graph, list[KernelSpec]]:
    lowered, _ = lower(spec.graph)
    kernels = [plan_kernel(g, n, options) for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL]
    return lowered, kernels


def build_model(spec: ModelSpec, sms: list[int], *, jobs: int = 1, cache_dir: Path | None = None,
                options: PlanOptions = PlanOptions(), quiet: bool = False) -> BuildReport:
    started = time.perf_counter()
    lowered, kernels = plan_model(spec, options)
    version = triton_version()
    root = cache_root(cache_dir)
    # Triton keeps a cache of its own; keep it inside ours, so that clearing ours means compiling from scratch.
    os.environ["TRITON_CACHE_DIR"] = str(root / ".triton")
    ir_text = {(g.name, n.name): _kernel_ir(n) for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL}
    todo: dict[tuple[int, str], LaunchSpec] = {}
    entries: dict[tuple[int, str], dict] = {}
    for sm in sms:
        for kernel in kernels:
            for launch in _launches(kernel):
                key = launch_key(ir_text[(kernel.graph, kernel.node)], launch, sm, "triton", version)
                cached = read_entry(sm_folder(root, sm), key)
                if cached is not None:
                    entries[(sm, key)] = cached
                else:
                    todo[(sm, key)] = launch
    report = BuildReport(sms, len(kernels), sum(len(_launches(k)) for k in kernels), cache=root)
    report.hits = len(entries)
    progress = None if quiet or not todo else Progress("compiling", len(todo))
    for (sm, key), compiled in _compile_all(todo, jobs, progress):
        entries[(sm, key)] = write_entry(sm_folder(root, sm), key, compiled.cubin,
                                         {"ptx": compiled.ptx, "py": todo[(sm, key)].source},
                                         _entry_meta(compiled, todo[(sm, key)]))
    report.built = len(todo)
    for sm in sms:
        report.manifests.append(_write_manifest(spec, sm, root, kernels, entries, ir_text, version, options))
    report.seconds = time.perf_counter() - started
    return report


def _launches(kernel: KernelSpec) -> list[LaunchSpec]:
    return [launch for variant in kernel.variants for launch in variant.launches]


def _kernel_ir(node) -> str:
    return "\n".join([format_node(node), *(format_node(inner) for inner in node.attrs["nodes"])])


def _compile_all(todo: dict[tuple[int, str], LaunchSpec], jobs: int, progress: Progress | None):
    """Compiles in fresh processes: Triton decides once per process, when it is imported, whether its kernels
    are compiled or interpreted, so the compiler never shares a process with the CPU interpreter."""
    if not todo:
        return
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(todo))), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_compiler_process) as pool:
        futures = {pool.submit(compile_launch, launch, sm): (sm, key) for (sm, key), launch in todo.items()}
        for future in futures:
            yield futures[future], future.result()
            if progress:
                progress.advance()


def _compiler_process() -> None:
    os.environ["TRITON_INTERPRET"] = "0"


def _entry_meta(compiled, launch: LaunchSpec) -> dict:
    return {"function": compiled.function, "shared": compiled.shared, "num_warps": compiled.num_warps,
            "scratch": compiled.scratch, "triton_version": compiled.triton_version, "source": launch.module,
            "pdl": compiled.pdl}


def _write_manifest(spec: ModelSpec, sm: int, root: Path, kernels: list[KernelSpec], entries: dict,
                    ir_text: dict, version: str, options: PlanOptions) -> Path:
    records = []
    for kernel in kernels:
        record = kernel.as_json()
        for variant, planned in zip(record["variants"], kernel.variants):
            for launch, spec_launch in zip(variant["launches"], planned.launches):
                key = launch_key(ir_text[(kernel.graph, kernel.node)], spec_launch, sm, "triton", version)
                entry = entries[(sm, key)]
                launch.update(key=key, cubin=entry["cubin"], sha256=entry["sha256"], symbol=entry["function"],
                              shared=entry["shared"], num_warps=entry["num_warps"], pdl=entry.get("pdl", False),
                              params=launch["params"] + _scratch_params(entry["scratch"]))
        records.append(record)
    manifest = {"model": spec.architecture, "model_id": model_id(spec), "config": str(spec.config_path),
                "sm": sm, "backend": "triton", "backend_version": version, "block_size": options.block_size,
                "kernels": records}
    path = manifest_path(root, sm, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _scratch_params(scratch: dict[str, int]) -> list[dict]:
    """Triton 3.6 appends two pointers to every kernel: global and profile scratch (0 when their size is 0)."""
    return [{"name": f"{which}_scratch", "kind": "scratch", "value": str(scratch[f"{which}_scratch_size"]),
             "dtype": "*i8", "align": scratch[f"{which}_scratch_align"]} for which in ("global", "profile")]


