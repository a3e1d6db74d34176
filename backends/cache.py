"""The content-addressed cubin cache: one folder per SM; an entry's key covers the kernel's IR, its generated
source, the backend and its version, the compile options and the SM. Every entry records its cubin's sha256, so a
corrupt or truncated cubin is found before it is loaded, and rebuilt."""

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pegainfer
from pegainfer.backends.manifest import Manifest, read
from pegainfer.backends.spec import LaunchSpec
from pegainfer.frontends.features import FEATURES
from pegainfer.frontends.kv_cache import has_fp8_cache
from pegainfer.ir.graph import REPEAT
from pegainfer.ir.step import FEATURES_INPUT

CACHE_ENV = "PEGAINFER_CACHE"


def cache_root(override: Path | None = None) -> Path:
    """--cache-dir, else $PEGAINFER_CACHE, else aot_cache/ of a source checkout, else ~/.cache/pegainfer."""
    if override is not None:
        return Path(override)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    checkout = Path(pegainfer.__file__).resolve().parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "aot_cache").is_dir():
        return checkout / "aot_cache"
    return Path.home() / ".cache" / "pegainfer"


def sm_folder(root: Path, sm: int) -> Path:
    return root / f"sm_{sm}"


def model_id(spec: Any) -> str:
    """Names a model by its parsed config, so the same model saved by another transformers version matches, by
    its FP8 weights and KV cache where it has them (which, and their scale blocks: the kernels differ), and for one
    rank of a sharded model by that rank's slices of the checkpoint, named `-tp<world>-rank<rank>` (a manifest of
    one layout never loads for another), and for a drafter's graphs (a target giving features, a head reading
    them) by which graph it is, named `-features`."""
    named: dict = asdict(spec.config)
    fp8 = sorted({(n.inputs[1], *n.attrs["block"]) for g in spec.graph.all_graphs() for n in g.nodes
                  if n.op == "dequantize"})
    fp8_kv = has_fp8_cache(spec.graph)
    shards = sorted((name, s.axis, s.start, s.stop, s.pad) for name, s in spec.graph.checkpoint_shards().items())
    lora = lora_tables(spec.graph)
    features = feature_layout(spec.graph)
    if fp8 or fp8_kv or shards or lora or features:
        named = {"config": named, "fp8": fp8, **({"kv_cache": "fp8"} if fp8_kv else {}),
                 **({"shards": shards} if shards else {}), **({"lora": lora} if lora else {}),
                 **({"features": features} if features else {})}
    digest = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:12]
    layout = parallel_layout(spec.graph)
    suffix = "" if layout is None else f"-tp{layout[0]}" + (f"-rank{layout[1]}" if layout[1] is not None else "")
    suffix += f"-lora{lora[0]}x{lora[1]}" if lora else ""
    suffix += "-features" if features else ""
    return f"{spec.architecture}-{digest}{suffix}"


def feature_layout(graph: Any) -> list | None:
    """For a graph that gives a drafter features or reads them: its name, the layer counts of its repeats (where a
    target's stream is tapped) and what makes its features output, of which values in which order; None for any
    other graph."""
    if FEATURES not in graph.outputs and FEATURES_INPUT not in graph.inputs:
        return None
    producer = graph.producers().get(FEATURES)
    return [graph.name, [n.attrs["count"] for n in graph.nodes if n.op == REPEAT],
            producer and [producer.op, *producer.inputs]]


def lora_tables(graph: Any) -> tuple[int, int] | None:
    """(slots, rank) of a graph's LoRA tables (frontends/lora.py: a table stacks the rank of each projection its
    name joins with +), None without them."""
    for g in graph.all_graphs():
        for name, t in g.states.items():
            if name.endswith(".lora_A"):
                return t.shape[0], t.shape[1] // (name.rpartition(".")[0].rpartition(".")[2].count("+") + 1)
    return None


def parallel_layout(graph: Any) -> tuple[int, int | None] | None:
    """(world, rank) of one rank's graph (passes/shard.py), None for a graph on one device: the world from its
    collectives, the rank from a checkpoint tensor split into `world` equal parts (rank r holds the r-th); rank
    None where no tensor is (the slices' digest in model_id tells ranks apart anyway)."""
    worlds = {n.attrs["world"] for g in graph.all_graphs() for n in g.nodes if "world" in n.attrs}
    if not worlds:
        return None
    world = max(worlds)
    for _, shard in sorted(graph.checkpoint_shards().items()):
        size = shard.stop - shard.start
        if size and not shard.pad and size * world == shard.full.shape[shard.axis] and shard.start % size == 0:
            return world, shard.start // size
    return world, None


def manifest_path(root: Path, sm: int, spec: Any) -> Path:
    return sm_folder(root, sm) / "manifests" / f"{model_id(spec)}.json"


def read_manifest(path: Path) -> Manifest | None:
    """The manifest if it is one of this pegainfer's format; None, like read_entry's, means build it: `pegainfer
    compile` rewrites a manifest whole, so a truncated one costs no compiling."""
    return read(path)


def launch_key(kernel_ir: str, launch: LaunchSpec, sm: int, backend: str, backend_version: str) -> str:
    blob = json.dumps({"ir": kernel_ir, "source": launch.source, "function": launch.function,
                       "constexprs": repr(sorted(launch.constexprs.items())),
                       "params": [asdict(p) for p in launch.params], "grid": repr(launch.grid),
                       "options": {"num_warps": launch.num_warps, "num_stages": launch.num_stages},
                       "backend": backend, "version": backend_version, "sm": sm}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_entry(folder: Path, key: str) -> dict | None:
    """The entry's metadata if its cubin is present and matches its recorded hash; None means build it."""
    meta_path, cubin_path = folder / f"{key}.json", folder / f"{key}.cubin"
    if not meta_path.is_file() or not cubin_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return None
    return meta if sha256_of(cubin_path.read_bytes()) == meta.get("sha256") else None


def write_entry(folder: Path, key: str, cubin: bytes, files: dict[str, str], meta: dict) -> dict:
    """Writes the cubin, its text companions (ptx, source) and the metadata last, each atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / f"{key}.cubin", cubin)
    for suffix, text in files.items():
        _write_atomic(folder / f"{key}.{suffix}", text.encode())
    meta = {**meta, "key": key, "cubin": f"{key}.cubin", "sha256": sha256_of(cubin)}
    _write_atomic(folder / f"{key}.json", json.dumps(meta, indent=1).encode())
    return meta


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    temporary.replace(path)
