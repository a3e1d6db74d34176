"""From what a user names (a checkpoint folder, a config.json, or the name of an embedded config) to a model:
its DAG module, parsed config, IR graph and, for a checkpoint, its weights bound by name."""

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

import numpy as np

from pegainfer.errors import ConfigError
from pegainfer.frontends.checkpoint import LazyWeights, check_weights, load_weights, scan_checkpoint
from pegainfer.frontends.config import architecture_of, parse_config, read_config
from pegainfer.frontends.registry import dag_module_for
from pegainfer.ir import Graph


@dataclass
class ModelSpec:
    """A model without weights: enough to compile, inspect or allocate for it."""
    config_path: Path
    raw_config: dict[str, Any]
    architecture: str
    dag: ModuleType
    config: Any
    graph: Graph

    @property
    def dag_file(self) -> str:
        return Path(self.dag.__file__).name


@dataclass
class LoadedModel:
    spec: ModelSpec
    folder: Path
    weights: Mapping[str, np.ndarray]


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


def load_spec(config_path: Path) -> ModelSpec:
    raw = read_config(config_path)
    source = str(config_path)
    architecture = architecture_of(raw, source)
    dag = dag_module_for(architecture, source)
    config = parse_config(dag.Config, raw, source)
    try:
        dag.check_config(config)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return ModelSpec(config_path, raw, architecture, dag, config, dag.build_graph(config))


def load_model(folder: Path, *, lazy: bool = False) -> LoadedModel:
    """A checkpoint folder: config.json, the DAG file it names, and every weight the graph reads, checked.
    `lazy` reads each weight from disk only when it is used (the GPU uploader's way)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a checkpoint folder")
    spec = load_spec(folder / "config.json")
    expected = spec.graph.checkpoint_params()
    tensors = scan_checkpoint(folder)
    check_weights(expected, tensors, folder)
    weights = LazyWeights(expected, tensors) if lazy else load_weights(expected, tensors)
    return LoadedModel(spec, folder, weights)
