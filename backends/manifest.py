"""The build-to-runtime contract: what `pegainfer compile` writes per model and SM, and all the runtime reads of
it (the executor, the launcher, TMA encoding, `pegainfer tune`, `inspect`). One JSON file, readable; `dump`
writes it and `load` gives it back as these dataclasses. It records which lowering it was compiled from (digests
of the pass pipeline and of the lowered graph's text form), so that a runtime lowering the model otherwise
refuses it instead of launching kernels planned for another graph."""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from pegainfer.backends.spec import GridDim, Param, Slotted
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph
from pegainfer.ir.printer import format_graph
from pegainfer.ir.types import TensorType
from pegainfer.passes.pipeline import DEFAULT_PASSES

FORMAT = 2  # the layout's version: a manifest of another reads as missing, and `pegainfer compile` rewrites it


@dataclass(frozen=True)
class Launch:
    """One compiled launch: its plan (function, constexprs, parameter ABI, grid rule) and its cubin."""
    function: str
    module: str
    params: tuple[Param, ...]
    constexprs: dict[str, int | float | bool | None]
    grid: tuple[GridDim, GridDim, GridDim]
    num_warps: int
    num_stages: int
    backend: str
    deferred: bool  # run only where a kernel after it reads what it writes (runtime/gpu/planes.py)
    key: str  # the cache entry
    cubin: str  # its file, beside the manifests' folder
    sha256: str
    symbol: str  # the kernel's name in the cubin
    shared: int  # dynamic shared memory, bytes
    threads: int  # block size (x only)
    pdl: bool  # compiled to wait for its predecessor itself (programmatic dependent launch)
    cluster: tuple[int, int, int] = (1, 1, 1)  # the thread block cluster the launch asks for


@dataclass(frozen=True)
class Variant(Slotted):
    name: str
    max_rows: int | None
    launches: tuple[Launch, ...]
    backend: str
    min_sizes: dict[str, int] = field(default_factory=dict)
    sms: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Selection:
    """How one slot's variant was chosen: by tuning (with its times) or the SM's default."""
    slot: str
    alternatives: tuple[str, ...]  # labels
    by: str  # tuned, default
    chosen: str  # a label, or "fallthrough" (a conditional slot left empty)
    times_us: dict[str, float] = field(default_factory=dict)


@dataclass
class Kernel:
    graph: str
    node: str
    kind: str
    ops: tuple[str, ...]
    row_symbol: str  # the step size that picks the variant (tokens, batch, samples)
    variants: list[Variant]  # what the runtime launches, in the order it tries them (pick_variant)
    candidates: list[Variant]  # every variant compiled, which `pegainfer tune` times and chooses among
    selection: list[Selection]
    scratch: dict[str, TensorType]  # buffers the chosen variants' launches use besides the graph's
    candidate_scratch: dict[str, TensorType]  # those every candidate uses


@dataclass
class Manifest:
    model: str  # the architecture
    model_id: str
    config: str  # the config.json it was compiled from
    sm: int
    backends: dict[str, str]  # backend -> version
    block_size: int  # KV-cache block size, a constant of the attention kernels
    pipeline_digest: str  # of the pass pipeline that lowered the model
    graph_digest: str  # of the lowered graph's text form
    kernels: list[Kernel]


def pipeline_digest() -> str:
    """The default pass pipeline's passes, in order."""
    return _digest("\n".join(f"{p.phase}/{p.name}" for p in DEFAULT_PASSES))


def graph_digest(lowered: Graph) -> str:
    """The lowered graph's stable text form (the layer body once: cheap), memory plan included."""
    return _digest(format_graph(lowered))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_lowering(manifest: Manifest, path: Path, lowered: Graph) -> None:
    """Refuses a manifest compiled from another lowering of the model than `lowered` (the runtime's own)."""
    if (manifest.pipeline_digest, manifest.graph_digest) != (pipeline_digest(), graph_digest(lowered)):
        raise PegainferError(f"{path}: compiled from another lowering of this model (pass pipeline or graph differs "
                             f"from this pegainfer's); run `pegainfer compile` again")


def dump(manifest: Manifest, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_manifest_json(manifest), indent=1))


def load(path: Path) -> Manifest:
    """The manifest at `path`; an error naming it where it is missing, unreadable or of another format."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PegainferError(f"{path}: no such manifest; `pegainfer compile` writes it") from None
    except (OSError, ValueError) as error:
        raise PegainferError(f"{path}: not a readable manifest ({error}); `pegainfer compile` rewrites it") from None
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise PegainferError(f"{path}: a manifest of format {found}, this pegainfer reads format {FORMAT}; "
                             f"`pegainfer compile` rewrites it")
    try:
        return _manifest(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise PegainferError(f"{path}: a malformed manifest ({type(error).__name__}: {error}); `pegainfer compile` "
                             f"rewrites it") from None


def read(path: Path) -> Manifest | None:
    """The manifest, or None where `load` would refuse it: what `pegainfer compile` is to (re)write."""
    try:
        return load(path)
    except PegainferError:
        return None


def _manifest(data: dict) -> Manifest:
    return Manifest(data["model"], data["model_id"], data["config"], data["sm"], dict(data["backends"]),
                    data["block_size"], data["pipeline_digest"], data["graph_digest"],
                    [_kernel(k) for k in data["kernels"]])


def _manifest_json(m: Manifest) -> dict:
    return {"format": FORMAT, "model": m.model, "model_id": m.model_id, "config": m.config, "sm": m.sm,
            "backends": m.backends, "block_size": m.block_size, "pipeline_digest": m.pipeline_digest,
            "graph_digest": m.graph_digest, "kernels": [_kernel_json(k) for k in m.kernels]}


def _kernel(data: dict) -> Kernel:
    return Kernel(data["graph"], data["node"], data["kind"], tuple(data["ops"]), data["row_symbol"],
                  [_variant(v) for v in data["variants"]], [_variant(v) for v in data["candidates"]],
                  [Selection(s["slot"], tuple(s["alternatives"]), s["by"], s["chosen"], dict(s["times_us"]))
                   for s in data["selection"]],
                  _scratch(data["scratch"]), _scratch(data["candidate_scratch"]))


def _kernel_json(k: Kernel) -> dict:
    return {"graph": k.graph, "node": k.node, "kind": k.kind, "ops": list(k.ops), "row_symbol": k.row_symbol,
            "scratch": _scratch_json(k.scratch), "candidate_scratch": _scratch_json(k.candidate_scratch),
            "selection": [{"slot": s.slot, "alternatives": list(s.alternatives), "by": s.by, "chosen": s.chosen,
                           "times_us": s.times_us} for s in k.selection],
            "variants": [_variant_json(v) for v in k.variants],
            "candidates": [_variant_json(v) for v in k.candidates]}


def _scratch(data: dict) -> dict[str, TensorType]:
    return {name: TensorType(dtype_from_name(dtype), tuple(shape)) for name, (dtype, shape) in data.items()}


def _scratch_json(scratch: dict[str, TensorType]) -> dict:
    return {name: [t.dtype.name, list(t.shape)] for name, t in scratch.items()}


def _variant(data: dict) -> Variant:
    sms = tuple(data["sms"]) if data["sms"] is not None else None
    return Variant(data["name"], data["max_rows"], tuple(_launch(launch) for launch in data["launches"]),
                   data["backend"], dict(data["min_sizes"]), sms)


def _variant_json(v: Variant) -> dict:
    return {"name": v.name, "label": v.label, "backend": v.backend, "max_rows": v.max_rows,
            "min_sizes": v.min_sizes, "sms": list(v.sms) if v.sms is not None else None,
            "launches": [_launch_json(launch) for launch in v.launches]}


def _launch(data: dict) -> Launch:
    return Launch(data["function"], data["module"], tuple(Param.from_json(p) for p in data["params"]),
                  dict(data["constexprs"]), tuple(GridDim.from_json(d) for d in data["grid"]), data["num_warps"],
                  data["num_stages"], data["backend"], data["deferred"], data["key"], data["cubin"], data["sha256"],
                  data["symbol"], data["shared"], data["threads"], data["pdl"], tuple(data["cluster"]))


def _launch_json(launch: Launch) -> dict:
    return {"function": launch.function, "module": launch.module, "symbol": launch.symbol,
            "params": [p.as_json() for p in launch.params], "constexprs": launch.constexprs,
            "grid": [{"factors": list(d.factors), "block": d.block, "times": d.times} for d in launch.grid],
            "num_warps": launch.num_warps, "num_stages": launch.num_stages, "threads": launch.threads,
            "shared": launch.shared, "cluster": list(launch.cluster), "pdl": launch.pdl, "backend": launch.backend,
            "deferred": launch.deferred, "key": launch.key, "cubin": launch.cubin, "sha256": launch.sha256}
