"""Finds a model's DAG file by config.json's `architectures`: every module in pegainfer.models that declares
ARCHITECTURES serves those names, so a new architecture is a new file and nothing else.

A DAG module provides:
  ARCHITECTURES: tuple[str, ...]  the `architectures` values of config.json it serves
  MODEL_TYPE: str                 Hugging Face's `model_type` (used to make random test checkpoints)
  Config: a dataclass             parsed from config.json by frontends.config.parse_config
  check_config(config) -> None    raises ConfigError for settings the file does not implement
  build_graph(config) -> Graph    the whole model, its layer declared once
  TINY_CONFIG: dict               a small config.json body for tests and `pegainfer make-checkpoint`
and may provide WRAPPERS (multimodal architectures whose text stack it is: frontends/text_stack.py) with
TEXT_DEFAULTS (the text model's defaults for keys a wrapper's text_config leaves out), and FUSED_EXPERTS (its
checkpoints may store a layer's experts fused: frontends/fused_experts.py).
"""

import importlib
import pkgutil
from functools import cache
from types import ModuleType

import pegainfer.models
from pegainfer.errors import ConfigError

REQUIRED = ("ARCHITECTURES", "MODEL_TYPE", "Config", "check_config", "build_graph", "TINY_CONFIG")


@cache
def dag_modules() -> dict[str, ModuleType]:
    """architecture name -> DAG module, over every module of pegainfer.models."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(pegainfer.models.__path__):
        module = importlib.import_module(f"pegainfer.models.{info.name}")
        if not hasattr(module, "ARCHITECTURES"):
            continue
        missing = [name for name in REQUIRED if not hasattr(module, name)]
        assert not missing, f"DAG file {module.__file__} lacks {missing}"
        for arch in (*module.ARCHITECTURES, *getattr(module, "WRAPPERS", {})):
            assert arch not in found, f"architecture {arch} claimed by {found[arch].__file__} and {module.__file__}"
            found[arch] = module
    return found


def dag_module_for(architecture: str, source: str) -> ModuleType:
    modules = dag_modules()
    if architecture not in modules:
        raise ConfigError(f"{source}: architecture {architecture!r} is not supported; "
                          f"supported: {', '.join(sorted(modules))}")
    return modules[architecture]


@cache
def drafter_modules() -> dict[str, ModuleType]:
    """architecture name -> DAG module of a draft head (DRAFTER_ARCHITECTURES, build_graphs, Config,
    check_config): heads that speculative decoding runs beside a target, never served alone."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(pegainfer.models.__path__):
        module = importlib.import_module(f"pegainfer.models.{info.name}")
        for arch in getattr(module, "DRAFTER_ARCHITECTURES", ()):
            found[arch] = module
    return found
