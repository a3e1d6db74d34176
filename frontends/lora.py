"""LoRA adapters over a model's graph. `with_lora` gives each target projection (a linear over a checkpoint
weight named `<module>.weight`, module among q/k/v/o/gate/up/down_proj) stacked tables for the loaded adapters:
states `<module>.lora_A` [slots, rank, in], `.lora_B` [slots, out, rank] and `.lora_scale` [slots] that the
runtime fills, and a `lora` node (ir/ops/lora.py) added to its output, each token's slot the step input LORA_SLOTS.
`read_adapter` reads a PEFT folder (adapter_config.json, adapter_model.safetensors) into the rows of those tables."""

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.ir.dtypes import FP32, INT32
from pegainfer.ir.graph import REPEAT, Graph, Node, instantiate
from pegainfer.ir.registry import infer_types
from pegainfer.ir.step import LORA_SLOTS
from pegainfer.ir.types import TensorType

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TABLES = ("lora_A", "lora_B", "lora_scale")
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraConfig:
    """--max-loras adapters loaded at once (slots of the tables), of rank --max-lora-rank at most."""
    max_loras: int = 1
    max_rank: int = 16


@dataclass
class Adapter:
    """An adapter's rows for the tables: module (an expanded weight prefix) -> (A [rank, in], B [out, rank])."""
    name: str
    path: Path
    rank: int
    scale: float
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def with_lora(graph: Graph, config: LoraConfig) -> Graph:
    """The graph with LoRA tables and updates on every target projection, and the step input LORA_SLOTS."""
    graph = copy.deepcopy(graph)
    graph.inputs[LORA_SLOTS] = TensorType(INT32, ("tokens",))
    for node in graph.nodes:
        if node.op == REPEAT:
            node.inputs = (*node.inputs, LORA_SLOTS)
            graph.subgraphs[node.attrs["body"]].inputs[LORA_SLOTS] = TensorType(INT32, ("tokens",))
    for g in graph.all_graphs():
        _add_updates(g, config)
    return graph


def _add_updates(g: Graph, config: LoraConfig) -> None:
    nodes = []
    types = g.value_types()
    for node in g.nodes:
        nodes.append(node)
        module = _target_module(g, node)
        if module is None:
            continue
        x, out_type = types[node.inputs[0]], node.output_types[0]
        tables = [f"{module}.{table}" for table in TABLES]
        g.states[tables[0]] = TensorType(x.dtype, (config.max_loras, config.max_rank, x.shape[1]))
        g.states[tables[1]] = TensorType(x.dtype, (config.max_loras, out_type.shape[1], config.max_rank))
        g.states[tables[2]] = TensorType(FP32, (config.max_loras,))
        result, base, update = node.outputs[0], f"{node.outputs[0]}.base", f"{node.outputs[0]}.lora"
        node.outputs = (base,)
        lora = Node("lora", (node.inputs[0], *tables, LORA_SLOTS), (update,), (), {})
        add = Node("add", (base, update), (result,), (), {})
        for new in (lora, add):
            new.output_types = infer_types(new.op, [({**types, **g.states, base: out_type})[v] for v in new.inputs],
                                           new.attrs)
            types[new.outputs[0]] = new.output_types[0]
        nodes += [lora, add]
    g.nodes = nodes


def _target_module(g: Graph, node: Node) -> str | None:
    """The weight prefix (`model.layers.{layer}.self_attn.q_proj`) of a linear over a plain target weight."""
    if node.op != "linear" or node.inputs[1] not in g.params or node.inputs[1] in g.derived:
        return None
    prefix, _, suffix = node.inputs[1].rpartition(".")
    return prefix if suffix == "weight" and prefix.rpartition(".")[2] in TARGETS else None


def lora_modules(graph: Graph) -> dict[str, tuple[int, int]]:
    """Expanded module name -> (in, out) of every projection a graph with LoRA tables updates."""
    modules = {}
    for g, layer in graph.instances():
        for name, t in g.states.items():
            if name.endswith(".lora_A"):
                expanded = name[:-len(".lora_A")] if layer is None else instantiate(name[:-len(".lora_A")], layer)
                modules[expanded] = (t.shape[2], g.states[name[:-1] + "B"].shape[1])
    return modules


def read_adapter(name: str, path: Path, graph: Graph, config: LoraConfig) -> Adapter:
    """A PEFT adapter folder checked against the model (its modules, their shapes) and the tables' rank."""
    settings = _read_settings(path)
    rank, alpha = settings["r"], settings["lora_alpha"]
    if rank > config.max_rank:
        raise ConfigError(f"LoRA adapter {name} ({path}): rank {rank} exceeds --max-lora-rank {config.max_rank}")
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"LoRA adapter {name} ({path}): no adapter_model.safetensors")
    tensors = load_file(file)
    modules = lora_modules(graph)
    adapter = Adapter(name, path, rank, scale)
    for key in sorted(tensors):
        module, kind = _module_of(key, name, path)
        if module not in modules:
            raise ConfigError(f"LoRA adapter {name} ({path}): it targets {module}, which this model has no LoRA "
                              f"table for (projections {', '.join(TARGETS)} of its layers)")
        a, b = adapter.modules.get(module, (None, None))
        adapter.modules[module] = (tensors[key], b) if kind == "lora_A" else (a, tensors[key])
    for module, (a, b) in adapter.modules.items():
        size_in, size_out = modules[module]
        if a is None or b is None or a.shape != (rank, size_in) or b.shape != (size_out, rank):
            raise CheckpointError(f"LoRA adapter {name} ({path}): {module} needs lora_A [{rank}, {size_in}] and "
                                  f"lora_B [{size_out}, {rank}], found {None if a is None else list(a.shape)} and "
                                  f"{None if b is None else list(b.shape)}")
    return adapter


def _read_settings(path: Path) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ConfigError(f"LoRA adapter at {path}: no adapter_config.json (a PEFT adapter folder is expected)")
    settings = json.loads(file.read_text())
    checks = [(settings.get("peft_type", "LORA") == "LORA", "peft_type LORA"),
              (isinstance(settings.get("r"), int) and settings["r"] > 0, "a positive integer r"),
              (isinstance(settings.get("lora_alpha"), (int, float)), "a number lora_alpha"),
              (settings.get("bias", "none") == "none", "bias \"none\""),
              (not settings.get("modules_to_save"), "no modules_to_save"),
              (not settings.get("fan_in_fan_out"), "fan_in_fan_out false"),
              (not settings.get("use_dora"), "no DoRA (use_dora false)")]
    for ok, wanted in checks:
        if not ok:
            raise ConfigError(f"LoRA adapter at {path}: adapter_config.json must have {wanted}")
    return settings


def _module_of(key: str, name: str, path: Path) -> tuple[str, str]:
    """A PEFT tensor name as (module, lora_A or lora_B)."""
    stem = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    module, _, rest = stem.partition(".lora_")
    if rest not in ("A.weight", "B.weight"):
        raise CheckpointError(f"LoRA adapter {name} ({path}): tensor {key!r} is not a lora_A or lora_B weight")
    return module, "lora_" + rest[0]


def adapter_rows(adapter: Adapter | None, graph: Graph) -> dict[str, np.ndarray]:
    """An adapter's rows of every table of `graph` (zeros for the modules it leaves alone; all zeros for None),
    by expanded table name: what an engine writes into one slot."""
    writes, states = {}, graph.expanded_states()
    for module in lora_modules(graph):
        a, b = adapter.modules.get(module, (None, None)) if adapter else (None, None)
        rank = a.shape[0] if a is not None else 0
        table_a = np.zeros(states[f"{module}.lora_A"].shape[1:], np.float32)
        table_b = np.zeros(states[f"{module}.lora_B"].shape[1:], np.float32)
        if a is not None:
            table_a[:rank], table_b[:, :rank] = a, b
        writes[f"{module}.lora_A"], writes[f"{module}.lora_B"] = table_a, table_b
        writes[f"{module}.lora_scale"] = np.float32(adapter.scale if a is not None else 0.0)
    return writes
