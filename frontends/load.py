"""From what a user names (a checkpoint folder, a config.json, or the name of an embedded config) to a model:
its DAG module, parsed config, IR graph and, for a checkpoint, its weights bound by name."""

from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

import numpy as np

from pegainfer.errors import CheckpointError, ConfigError, GraphError
from pegainfer.frontends.checkpoint import LazyWeights, TensorInfo, check_weights, load_weights, scan_checkpoint
from pegainfer.frontends.config import architecture_of, parse_config, read_config
from pegainfer.frontends.fused_experts import split_fused_experts
from pegainfer.frontends.kv_cache import apply_kv_cache_dtype, check_kv_scales
from pegainfer.frontends.online_quantization import QuantizedWeights, stored_params
from pegainfer.frontends.quantization import quantize_graph, scheme_for
from pegainfer.frontends.registry import dag_module_for
from pegainfer.frontends.text_stack import text_stack_config, text_stack_tensors
from pegainfer.ir import Graph
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.passes.pipeline import shard_graph
from pegainfer.passes.shard import Parallelism

# --dtype's choices: auto is the checkpoint's own (see serving_dtype); the others cast the weights on load.
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class ModelSpec:
    """A model without weights: enough to compile, inspect or allocate for it."""
    config_path: Path
    raw_config: dict[str, Any]
    architecture: str
    dag: ModuleType
    config: Any
    graph: Graph
    dtype_override: str | None = None  # the torch_dtype the graph was built with, when not config.json's

    @property
    def dag_file(self) -> str:
        return Path(self.dag.__file__).name

    @property
    def text_stack(self) -> bool:
        """A multimodal checkpoint of which pegainfer serves the text model (frontends/text_stack.py)."""
        return self.architecture in getattr(self.dag, "WRAPPERS", {})


@dataclass
class LoadedModel:
    spec: ModelSpec
    folder: Path
    weights: Mapping[str, np.ndarray]
    mtp: Mapping[str, np.ndarray] | None = None  # the checkpoint's MTP head, checked, read when used (mtp_head)


def embedded_configs() -> dict[str, Path]:
    """name -> config.json shipped in the package (pegainfer/models/configs/<name>.json)."""
    folder = resources.files("pegainfer.models") / "configs"
    return {Path(entry.name).stem: Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".json")}


def resolve_config_path(model: str) -> Path:
    """A checkpoint folder, a config.json file, or the name of an embedded config."""
    path = Path(model)
    if path.is_dir():
        return path / "config.json"
    if path.is_file():
        return path
    embedded = embedded_configs()
    if model.lower() in embedded:
        return embedded[model.lower()]
    raise ConfigError(f"{model}: not a folder, a config.json, or an embedded config "
                      f"(embedded: {', '.join(sorted(embedded))})")


def load_spec(config_path: Path, *, dtype: str = "auto", device: str = "cpu", quantization: str | None = None,
              kv_cache_dtype: str = "auto", parallel: Parallelism = Parallelism()) -> ModelSpec:
    """config.json and its DAG file's graph, stored in `dtype` (DTYPE_CHOICES) as the model runs on `device`;
    FP8 projections where the checkpoint's quantization_config, or `quantization` (frontends/quantization.py),
    says so; the KV cache in `kv_cache_dtype` (frontends/kv_cache.py); with `parallel` the graph of one rank
    (passes/shard.py)."""
    raw = read_config(config_path)
    source = str(config_path)
    architecture = architecture_of(raw, source)
    dag = dag_module_for(architecture, source)
    if architecture in getattr(dag, "WRAPPERS", {}):
        raw = text_stack_config(raw, dag, source)
    config = parse_config(dag.Config, raw, source)
    try:
        dag.check_config(config)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    served = serving_dtype(dtype, config.torch_dtype, device, getattr(dag, "FLOAT16_UNSUPPORTED", None))
    override = None if dtype_from_name(served) == dtype_from_name(config.torch_dtype) else served
    if override is not None:  # a new torch_dtype: model_id (the cubin cache's key) changes with it
        config = replace(config, torch_dtype=override)
    graph = dag.build_graph(config)
    fp8 = scheme_for(raw, source, quantization)
    if fp8 is not None:
        graph = quantize_graph(graph, fp8, dtype_from_name(config.torch_dtype))
    graph = apply_kv_cache_dtype(graph, kv_cache_dtype)
    if parallel.sharded:
        try:
            graph = shard_graph(graph, parallel)
        except GraphError as error:
            raise ConfigError(f"{source}: {error}") from None
    return ModelSpec(config_path, raw, architecture, dag, config, graph, override)


def serving_dtype(requested: str, checkpoint: str, device: str, float16_unsupported: str | None = None) -> str:
    """vLLM's --dtype rule: auto is the checkpoint's dtype, except that a float32 checkpoint runs as bfloat16 on a
    GPU (every SM pegainfer compiles for has bf16), and a model that declares float16 unstable
    (`FLOAT16_UNSUPPORTED = reason` in its DAG file) runs as bfloat16 instead; there an explicit float16 is refused.
    On the CPU a float32 checkpoint stays float32: the reference executor's math is float32 anyway."""
    if requested not in DTYPE_CHOICES:
        raise ConfigError(f"--dtype {requested}: expected one of {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        if requested == "float16" and float16_unsupported:
            raise ConfigError(f"--dtype float16: this model does not run in float16 ({float16_unsupported}); "
                              f"use bfloat16 or float32")
        return requested
    stored = dtype_from_name(checkpoint).name
    if stored == "f32" and device == "cuda":
        return "bfloat16"
    if stored == "f16" and float16_unsupported:
        return "bfloat16"
    return {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[stored]


def load_model(folder: Path, *, lazy: bool = False, dtype: str = "auto", device: str = "cpu",
               quantization: str | None = None, kv_cache_dtype: str = "auto",
               parallel: Parallelism = Parallelism()) -> LoadedModel:
    """A checkpoint folder: config.json, the DAG file it names, and every weight the graph reads, checked and cast
    to the graph's dtype (see load_spec), FP8 projections quantized here with `quantization`, params the checkpoint
    may lack (an FP8 cache's scales) filled with their defaults. `lazy` reads each weight from disk only when it is
    used (the GPU uploader's way). With `parallel`, one rank's graph and only its slices of the sharded
    tensors."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a checkpoint folder")
    if quantization and parallel.sharded:
        raise ConfigError(f"--quantization {quantization} with tensor parallelism is not implemented: quantize "
                          f"the checkpoint first, or serve it on one GPU")
    spec = load_spec(folder / "config.json", dtype=dtype, device=device, quantization=quantization,
                     kv_cache_dtype=kv_cache_dtype, parallel=parallel)
    shards = spec.graph.checkpoint_shards()
    expected = stored_params(spec.graph, dtype_from_name(spec.config.torch_dtype)) if quantization else \
        spec.graph.checkpoint_params()
    tensors = scan_checkpoint(folder)
    mtp = mtp_head(spec, tensors, folder, quantized=bool(quantization or "quantization_config" in spec.raw_config))
    if spec.text_stack:
        tensors = text_stack_tensors(tensors)
    if getattr(spec.dag, "FUSED_EXPERTS", False):
        tensors = split_fused_experts(tensors)
    defaults = spec.graph.param_defaults()  # an FP8 cache's scales
    filled = {name: np.full(expected[name].shape, value, expected[name].dtype.np_dtype)
              for name, value in defaults.items() if name not in tensors}
    stored = {name: t for name, t in expected.items() if name not in filled}
    check_weights(stored, tensors, folder, shards)
    weights = LazyWeights(expected, tensors, filled, shards) if lazy else \
        load_weights(stored, tensors, shards) | filled
    check_kv_scales({name: weights[name] for name in defaults if name not in filled}, str(folder))
    if quantization:  # scheme_for refused it for a checkpoint quantized already
        weights = QuantizedWeights(weights, spec.graph)
    return LoadedModel(spec, folder, weights, mtp)


def mtp_head(spec: ModelSpec, tensors: dict[str, TensorInfo], folder: Path, quantized: bool) -> LazyWeights | None:
    """The multi-token-prediction head a checkpoint carries (its DAG file's `mtp_params`, under `mtp_prefix`),
    every tensor checked for name and shape; None where the checkpoint or the config has none, or the checkpoint
    is quantized (an FP8 head is not run)."""
    layout = getattr(spec.dag, "mtp_params", None)
    expected = layout(spec.config) if layout is not None and not quantized else {}
    prefix = spec.dag.mtp_prefix(spec.config) if hasattr(spec.dag, "mtp_prefix") else "mtp."
    tensors = {name: t for name, t in tensors.items() if name.startswith(prefix)}
    if not tensors or not expected:
        return None
    if getattr(spec.dag, "FUSED_EXPERTS", False):
        tensors = split_fused_experts(tensors)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        key = spec.dag.MTP_LAYERS_KEY
        raise CheckpointError(f"{folder}: tensor {unexpected[0]!r} is not part of the MTP head of {key} "
                              f"{getattr(spec.config, key)}")
    check_weights(expected, tensors, folder)
    return LazyWeights(expected, tensors)
