"""From a model to a GPU engine in one call: the manifest for the visible SM from the cubin cache, compiled first
when it is missing and the compile extra is installed (what `pegainfer compile` would write), then the engine.
The compiler is imported only then, so a process that finds its manifest never loads it."""

import os
import sys
from pathlib import Path
from types import ModuleType

from pegainfer.backends.cache import cache_root, manifest_path, parallel_layout, read_manifest
from pegainfer.errors import PegainferError
from pegainfer.frontends.load import LoadedModel, ModelSpec
from pegainfer.frontends.quantization import refuse_fp8_below
from pegainfer.runtime import device
from pegainfer.runtime.gpu import engine

COMPILE_HINT = "or install the compile extra (pip install -e '.[compile]') and it is compiled at start"


def gpu_engine(model: LoadedModel, options: "engine.EngineOptions", cache_dir: Path | None = None, *,
               compile_missing: bool = True, communicator=None, on_step: "engine.StepHook | None" = None,
               lenders: tuple = (), kv_of: "engine.GpuEngine | None" = None) -> "engine.GpuEngine":
    """The engine on the visible GPU, its kernels from `cache_dir` (cache_root's rule), compiled if missing; one
    rank of a sharded model's with `communicator` (a Communicator, or the nccl.Rendezvous to make one); a draft
    head's with `lenders` and `kv_of` (GpuEngine's)."""
    sm = device.visible_sm()
    if sm is None:
        raise PegainferError("the GPU engine needs a visible CUDA device (and cuda-bindings: pip install -e '.[cuda]')")
    manifest = ensure_manifest(model.spec, sm, cache_dir, label=str(model.folder), compile_missing=compile_missing)
    return engine.GpuEngine(model, manifest, options, communicator, on_step, lenders=lenders, kv_of=kv_of)


def ensure_manifest(spec: ModelSpec, sm: int, cache_dir: Path | None = None, *, label: str,
                    compile_missing: bool = True, jobs: int | None = None) -> Path:
    """The model's manifest for `sm`; when there is none (or it is corrupt, or of an older format), compiled with
    every installed backend (with compile's progress bar) where the compile extra is installed, else an error
    saying which command makes it. `label` names the model in that command (a folder, a config.json or an embedded
    name)."""
    refuse_fp8_below(spec.graph, [sm])
    path = manifest_path(cache_root(cache_dir), sm, spec)
    if read_manifest(path) is not None:  # a corrupt one is rewritten, as `pegainfer compile` would
        return path
    layout = parallel_layout(spec.graph)
    command = f"{label} --sm {sm}" + (f" --dtype {spec.dtype_override}" if spec.dtype_override else "") + \
        (f" --tensor-parallel-size {layout[0]}" if layout else "")
    build = find_compiler() if compile_missing else None
    if build is None:
        raise engine.missing_manifest(path, command, hint=COMPILE_HINT if compile_missing else "")
    print(f"pegainfer: no compiled kernels for this model on sm_{sm} in {cache_root(cache_dir)}: compiling them "
          f"(as `pegainfer compile {command}` does)", file=sys.stderr, flush=True)
    report = build.build_model(spec, [sm], jobs=jobs or os.cpu_count() or 1, cache_dir=cache_dir)
    print(f"pegainfer: compiled {report.summary()}", file=sys.stderr, flush=True)
    return report.manifests[0]


def find_compiler() -> ModuleType | None:
    """pegainfer.backends.build where the compile extra is installed (triton, found by its package metadata:
    importing triton here would fix this process's compile-or-interpret mode), else None."""
    try:
        from pegainfer.backends import build
        from pegainfer.backends.triton.compiler import triton_version

        triton_version()
    except ImportError:
        return None
    return build
