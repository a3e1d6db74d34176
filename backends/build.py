"""`pegainfer compile`: lower a model, plan every kernel's candidates (Triton for every kernel; TileLang and CuTe
DSL where they are installed and have one), compile each launch for each SM it supports in parallel processes
(or take it from the cache), choose one variant per slot (tuning data, else the SM's default: select.py), and
write one manifest per SM that the runtime reads without any compiler."""

import json
import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pegainfer.backends.cache import cache_root, launch_key, manifest_path, model_id, read_entry, sm_folder, write_entry
from pegainfer.backends.select import choose, read_tuning, used_scratch
from pegainfer.backends.spec import KernelSpec, LaunchSpec, VariantSpec
from pegainfer.backends.triton.plan import PlanOptions, plan_kernel
from pegainfer.errors import PegainferError
from pegainfer.frontends.load import ModelSpec
from pegainfer.ir.graph import KERNEL, Graph
from pegainfer.ir.printer import format_node
from pegainfer.passes.pipeline import lower
from pegainfer.progress import Progress

SUPPORTED_SMS = (80, 86, 89, 90, 100, 120)
BACKENDS = ("triton", "tilelang", "cute")
_PACKAGES = {"triton": "triton", "tilelang": "tilelang", "cute": "nvidia-cutlass-dsl"}


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
    backends: dict[str, str] = field(default_factory=dict)  # used backend -> version
    skipped: dict[str, str] = field(default_factory=dict)  # backend left out -> why

    def summary(self) -> str:
        skipped = "".join(f"; {name} left out: {why}" for name, why in self.skipped.items())
        return (f"{self.kernels} kernels, {self.launches} launches per SM over their candidates, "
                f"{self.built + self.hits} distinct cubins for sm_{', sm_'.join(map(str, self.sms))}: "
                f"{self.built} compiled, {self.hits} cache hits, in {self.seconds:.1f} s "
                f"({', '.join(self.backends)}){skipped}; cache {self.cache}")


def parse_sms(text: str) -> list[int]:
    try:
        sms = [int(part) for part in text.replace("sm_", "").split(",") if part.strip()]
    except ValueError:
        raise PegainferError(f"--sm {text}: expected comma-separated compute capabilities such as 80,90") from None
    unknown = [sm for sm in sms if sm not in SUPPORTED_SMS]
    if not sms or unknown:
        raise PegainferError(f"--sm {text}: supported are {', '.join(map(str, SUPPORTED_SMS))}")
    return sms


def parse_backends(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or "triton" not in names:
        raise PegainferError(f"--backends {text}: choose among {', '.join(BACKENDS)}; triton is always needed "
                             f"(it serves every kernel)")
    return names


def available_backends(wanted: list[str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """({backend: version} of those installed (and, for TileLang, with nvcc), {backend: why not} of the rest)."""
    found, missing = {}, {}
    for name in wanted or BACKENDS:
        try:
            found[name] = version(_PACKAGES[name])
        except PackageNotFoundError:
            missing[name] = f"{_PACKAGES[name]} is not installed (pip install -e '.[kernels]')"
    if "tilelang" in found and not shutil.which("nvcc") and not os.environ.get("CUDA_HOME"):
        missing["tilelang"] = "nvcc is not on the PATH"
        del found["tilelang"]
    if "triton" not in found:
        raise ImportError("triton is not installed", name="triton")
    return found, missing


def plan_model(spec: ModelSpec, options: PlanOptions, backends: tuple[str, ...] = ("triton",)
               ) -> tuple[Graph, list[KernelSpec]]:
    """Every kernel's variants over the backends: Triton's first, then the others' candidates."""
    lowered, _ = lower(spec.graph)
    kernels = []
    for graph in lowered.all_graphs():
        for node in graph.nodes:
            if node.op != KERNEL:
                continue
            kernel = plan_kernel(graph, node, options)
            if "tilelang" in backends:
                from pegainfer.backends.tilelang import plan as tilelang_plan
                extra = tilelang_plan.candidates(graph, node, options)
                kernel.variants += extra
                kernel.scratch.update(tilelang_plan.gemm_scratch(graph, node, extra))
            if "cute" in backends:
                from pegainfer.backends.cute import plan as cute_plan
                kernel.variants += cute_plan.candidates(graph, node, options)
            kernels.append(kernel)
    return lowered, kernels


def build_model(spec: ModelSpec, sms: list[int], *, jobs: int = 1, cache_dir: Path | None = None,
                options: PlanOptions = PlanOptions(), quiet: bool = False,
                backends: list[str] | None = None) -> BuildReport:
    started = time.perf_counter()
    versions, skipped = available_backends(backends)
    lowered, kernels = plan_model(spec, options, tuple(versions))
    root = cache_root(cache_dir)
    # Triton keeps a cache of its own; keep it inside ours, so that clearing ours means compiling from scratch.
    os.environ["TRITON_CACHE_DIR"] = str(root / ".triton")
    ir_text = {(g.name, n.name): _kernel_ir(n) for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL}
    keys: dict[tuple[int, int], str] = {}  # (sm, id(launch)) -> cache key
    todo: dict[tuple[int, str], LaunchSpec] = {}
    entries: dict[tuple[int, str], dict] = {}
    for sm in sms:
        for kernel in kernels:
            for variant in _supported(kernel, sm):
                for launch in variant.launches:
                    key = launch_key(ir_text[(kernel.graph, kernel.node)], launch, sm, launch.backend,
                                     versions[launch.backend])
                    keys[(sm, id(launch))] = key
                    cached = read_entry(sm_folder(root, sm), key)
                    if cached is not None:
                        entries[(sm, key)] = cached
                    elif (sm, key) not in entries:
                        todo[(sm, key)] = launch
    launches = sum(len(v.launches) for k in kernels for v in _supported(k, sms[0]))
    report = BuildReport(sms, len(kernels), launches, cache=root, backends=versions, skipped=skipped)
    report.hits = len(entries)
    progress = None if quiet or not todo else Progress("compiling", len(todo))
    for (sm, key), compiled in compile_many(todo, jobs, progress):
        launch = todo[(sm, key)]
        files, meta = _entry_files_and_meta(compiled, launch)
        entries[(sm, key)] = write_entry(sm_folder(root, sm), key, compiled.cubin, files, meta)
    report.built = len(todo)
    for sm in sms:
        report.manifests.append(_write_manifest(spec, sm, root, kernels, entries, keys, versions, options))
    report.seconds = time.perf_counter() - started
    return report


def _supported(kernel: KernelSpec, sm: int) -> list[VariantSpec]:
    return [v for v in kernel.variants if v.sms is None or sm in v.sms]


def _kernel_ir(node) -> str:
    return "\n".join([format_node(node), *(format_node(inner) for inner in node.attrs["nodes"])])


def compile_launch(launch: LaunchSpec, sm: int):
    """One launch to a cubin, by its backend (run in a compiler process)."""
    if launch.backend == "tilelang":
        from pegainfer.backends.tilelang.compiler import compile_launch as compile_tilelang
        return compile_tilelang(launch, sm)
    if launch.backend == "cute":
        from pegainfer.backends.cute.compiler import compile_launch as compile_cute
        return compile_cute(launch, sm)
    from pegainfer.backends.triton.compiler import compile_launch as compile_triton
    return compile_triton(launch, sm)


def compile_many(todo: dict[tuple[int, str], LaunchSpec], jobs: int, progress: Progress | None):
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


def _entry_files_and_meta(compiled, launch: LaunchSpec) -> tuple[dict[str, str], dict]:
    if launch.backend == "triton":
        return ({"ptx": compiled.ptx, "py": launch.source},
                {"backend": "triton", "function": compiled.function, "shared": compiled.shared,
                 "num_warps": compiled.num_warps, "threads": 32 * compiled.num_warps, "scratch": compiled.scratch,
                 "triton_version": compiled.triton_version, "source": launch.module, "pdl": compiled.pdl})
    return compiled.files, {"backend": launch.backend, "function": compiled.function, "shared": compiled.shared,
                            "num_warps": compiled.threads // 32, "threads": compiled.threads, "abi": compiled.abi,
                            "resources": compiled.resources, "version": compiled.version, "source": launch.module,
                            "pdl": bool(launch.constexprs.get("PDL", False)),  # a template opts in by PDL=True
                            **({"cluster": list(compiled.cluster)} if compiled.cluster != (1, 1, 1) else {})}


def _write_manifest(spec: ModelSpec, sm: int, root: Path, kernels: list[KernelSpec], entries: dict, keys: dict,
                    versions: dict[str, str], options: PlanOptions) -> Path:
    tuning = read_tuning(root, sm, spec)
    records = []
    for kernel in kernels:
        supported = _supported(kernel, sm)
        chosen, selection = choose(kernel, supported, sm, tuning)
        record = kernel.as_json()
        del record["variants"]
        record["variants"] = [_variant_record(v, sm, entries, keys) for v in chosen]
        record["candidates"] = [_variant_record(v, sm, entries, keys) for v in supported]
        record["selection"] = selection
        record["candidate_scratch"] = record["scratch"]  # what timing every candidate needs (pegainfer tune)
        record["scratch"] = used_scratch(record)
        records.append(record)
    manifest = {"model": spec.architecture, "model_id": model_id(spec), "config": str(spec.config_path),
                "sm": sm, "backend": "triton", "backend_version": versions["triton"], "backends": versions,
                "block_size": options.block_size, "kernels": records}
    path = manifest_path(root, sm, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _variant_record(variant: VariantSpec, sm: int, entries: dict, keys: dict) -> dict:
    record = asdict(variant)
    record["label"] = variant.label
    for launch, planned in zip(record["launches"], variant.launches):
        del launch["source"]
        key = keys[(sm, id(planned))]
        entry = entries[(sm, key)]
        params = entry["abi"] if "abi" in entry else launch["params"] + _scratch_params(entry["scratch"])
        launch.update(key=key, cubin=entry["cubin"], sha256=entry["sha256"], symbol=entry["function"],
                      shared=entry["shared"], num_warps=entry["num_warps"],
                      threads=entry.get("threads", 32 * entry["num_warps"]), params=params,
                      pdl=entry.get("pdl", False), **({"cluster": entry["cluster"]} if "cluster" in entry else {}))
    return record


def _scratch_params(scratch: dict[str, int]) -> list[dict]:
    """Triton 3.6 appends two pointers to every kernel: global and profile scratch (0 when their size is 0)."""
    return [{"name": f"{which}_scratch", "kind": "scratch", "value": str(scratch[f"{which}_scratch_size"]),
             "dtype": "*i8", "align": scratch[f"{which}_scratch_align"]} for which in ("global", "profile")]
