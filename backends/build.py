"""`pegainfer compile`: lower a model, plan every kernel's candidates (Triton for every kernel; TileLang and CuTe
DSL where they are installed and have one), compile each launch for each SM it supports in parallel processes
(or take it from the cache), choose one variant per slot (tuning data, else the SM's default: select.py), and
write one manifest per SM that the runtime reads without any compiler; for a sharded model one per rank and SM,
the ranks compiled together (a launch they share is one cubin)."""

import multiprocessing
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pegainfer.backends.cache import cache_root, launch_key, manifest_path, model_id, read_entry, sm_folder, write_entry
from pegainfer.backends.manifest import Kernel, Launch, Manifest, Variant, dump, graph_digest, pipeline_digest
from pegainfer.backends.select import choose, read_tuning, used_scratch
from pegainfer.backends.spec import KernelSpec, LaunchSpec, Param, ParamKind, VariantSpec
from pegainfer.backends.triton.plan import PlanOptions, plan_kernel
from pegainfer.errors import PegainferError
from pegainfer.frontends.load import ModelSpec
from pegainfer.frontends.quantization import refuse_fp8_below
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import KERNEL, Graph
from pegainfer.ir.printer import format_node
from pegainfer.ir.types import TensorType
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
    ranks: int = 1  # the ranks of a sharded model built together (kernels and launches are a rank's)

    def summary(self) -> str:
        skipped = "".join(f"; {name} left out: {why}" for name, why in self.skipped.items())
        per = " a rank" if self.ranks > 1 else ""
        ranks = f"; {len(self.manifests)} rank manifests ({self.ranks} ranks)" if self.ranks > 1 else ""
        return (f"{self.kernels} kernels{per}, {self.launches} launches per SM over their candidates, "
                f"{self.built + self.hits} distinct cubins for sm_{', sm_'.join(map(str, self.sms))}: "
                f"{self.built} compiled, {self.hits} cache hits, in {self.seconds:.1f} s "
                f"({', '.join(self.backends)}){skipped}{ranks}; cache {self.cache}")


@dataclass
class Compiled:
    """The cache entries of a build's launches: (sm, id(planned launch)) -> key, (sm, key) -> entry metadata."""
    keys: dict[tuple[int, int], str] = field(default_factory=dict)
    entries: dict[tuple[int, str], dict] = field(default_factory=dict)

    def entry(self, sm: int, launch: LaunchSpec) -> dict:
        return self.entries[(sm, self.keys[(sm, id(launch))])]


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
    return build_models([spec], sms, jobs=jobs, cache_dir=cache_dir, options=options, quiet=quiet, backends=backends)


def build_models(specs: list[ModelSpec], sms: list[int], *, jobs: int = 1, cache_dir: Path | None = None,
                 options: PlanOptions = PlanOptions(), quiet: bool = False,
                 backends: list[str] | None = None, ranks: int | None = None) -> BuildReport:
    """Compiles the models together (the ranks of a sharded model, or a model and its draft head's graphs: each
    launch the cache lacks once, whichever share it) and writes a manifest per model and SM, in order: the
    report's `manifests`. `ranks`: how many of the specs are ranks (all, by default)."""
    started = time.perf_counter()
    for spec in specs:
        refuse_fp8_below(spec.graph, sms)
    versions, skipped = available_backends(backends)
    planned = [plan_model(spec, options, tuple(versions)) for spec in specs]
    root = cache_root(cache_dir)
    # Triton keeps a cache of its own; keep it inside ours, so that clearing ours means compiling from scratch.
    os.environ["TRITON_CACHE_DIR"] = str(root / ".triton")
    compiled, todo = Compiled(), {}
    for lowered, kernels in planned:
        _look_up(lowered, kernels, sms, root, versions, compiled, todo)
    kernels = planned[0][1]
    launches = sum(len(v.launches) for k in kernels for v in _supported(k, sms[0]))
    report = BuildReport(sms, len(kernels), launches, cache=root, backends=versions, skipped=skipped,
                         ranks=len(specs) if ranks is None else ranks)
    report.hits = len(compiled.entries)
    progress = None if quiet or not todo else Progress("compiling", len(todo))
    for (sm, key), native in compile_many(todo, jobs, progress):
        files, meta = _entry_files_and_meta(native, todo[(sm, key)])
        compiled.entries[(sm, key)] = write_entry(sm_folder(root, sm), key, native.cubin, files, meta)
    report.built = len(todo)
    for spec, (lowered, kernels) in zip(specs, planned):
        for sm in sms:
            report.manifests.append(_write_manifest(spec, sm, root, kernels, compiled, versions, options, lowered))
    report.seconds = time.perf_counter() - started
    return report


def _look_up(lowered: Graph, kernels: list[KernelSpec], sms: list[int], root: Path, versions: dict[str, str],
             compiled: Compiled, todo: dict[tuple[int, str], LaunchSpec]) -> None:
    """Records every launch's cache key per SM and the entries the cache holds in `compiled`, and the launches left
    to compile in `todo` (once per key)."""
    ir_text = {(g.name, n.name): _kernel_ir(n) for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL}
    for sm in sms:
        for kernel in kernels:
            for launch in (launch for variant in _supported(kernel, sm) for launch in variant.launches):
                key = launch_key(ir_text[(kernel.graph, kernel.node)], launch, sm, launch.backend,
                                 versions[launch.backend])
                compiled.keys[(sm, id(launch))] = key
                if (sm, key) in compiled.entries or (sm, key) in todo:
                    continue
                cached = read_entry(sm_folder(root, sm), key)
                if cached is not None:
                    compiled.entries[(sm, key)] = cached
                else:
                    todo[(sm, key)] = launch


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


def _write_manifest(spec: ModelSpec, sm: int, root: Path, kernels: list[KernelSpec], compiled: Compiled,
                    versions: dict[str, str], options: PlanOptions, lowered: Graph) -> Path:
    tuning = read_tuning(root, sm, spec)
    manifest = Manifest(spec.architecture, model_id(spec), str(spec.config_path), sm, versions, options.block_size,
                        pipeline_digest(), graph_digest(lowered),
                        [_compiled_kernel(kernel, sm, tuning, compiled) for kernel in kernels])
    path = manifest_path(root, sm, spec)
    dump(manifest, path)
    return path


def _compiled_kernel(kernel: KernelSpec, sm: int, tuning: dict, compiled: Compiled) -> Kernel:
    """The kernel's candidates for the SM with their cubins, and the variants chosen among them."""
    candidates = [Variant(v.name, v.max_rows, tuple(_compiled_launch(launch, compiled.entry(sm, launch))
                                                    for launch in v.launches), v.backend, dict(v.min_sizes), v.sms)
                  for v in _supported(kernel, sm)]
    chosen, selection = choose(kernel, candidates, sm, tuning)
    scratch = {name: TensorType(dtype_from_name(dtype), tuple(shape))
               for name, (dtype, shape) in kernel.scratch.items()}
    return Kernel(kernel.graph, kernel.node, kernel.kind, tuple(kernel.ops), kernel.row_symbol, chosen, candidates,
                  selection, used_scratch(chosen, scratch), scratch)


def _compiled_launch(planned: LaunchSpec, entry: dict) -> Launch:
    """The planned launch with its cubin, and the ABI its compiler reports (Triton's: the plan's, then its two
    scratch pointers)."""
    params = tuple(Param.from_json(p) for p in entry["abi"]) if "abi" in entry else \
        (*planned.params, *_scratch_params(planned.function, entry["scratch"]))
    return Launch(planned.function, planned.module, params, dict(planned.constexprs), planned.grid,
                  entry["num_warps"], planned.num_stages, planned.backend, planned.deferred, entry["key"],
                  entry["cubin"], entry["sha256"], entry["function"], entry["shared"], entry["threads"], entry["pdl"],
                  tuple(entry.get("cluster", (1, 1, 1))))


def _scratch_params(function: str, scratch: dict[str, int]) -> tuple[Param, ...]:
    """Triton 3.6 appends two pointers to every kernel, global and profile scratch, which the runtime passes null."""
    for which in ("global", "profile"):
        if scratch[f"{which}_scratch_size"]:
            raise PegainferError(f"{function}: Triton asks {scratch[f'{which}_scratch_size']} bytes of {which} "
                                 f"scratch, where the runtime passes none")
    return tuple(Param(f"{which}_scratch", ParamKind.SCRATCH, "0", "*i8") for which in ("global", "profile"))
