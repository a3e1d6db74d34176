"""LoRA adapters over a model's graph. `with_lora` gives each target projection (a linear over a checkpoint
weight named `<module>.weight` or its FP8 dequantize, module among q/k/v/o/gate/up/down_proj) stacked tables for
the loaded adapters: states `<module>.lora_A` [slots, rank, in], `.lora_B` [slots, out, rank] and `.lora_scale`
[slots] that the runtime fills, and a `lora` node (ir/ops/lora.py) added to its output, each token's slot the step
input LORA_SLOTS.
`read_adapter` reads a PEFT folder (adapter_config.json, adapter_model.safetensors) into the rows of those tables.
On a rank of a sharded graph (passes/shard.py) the tables are added to the rank's projections, so they hold its
part: a column-parallel projection's B its rows, a row-parallel one's A its input columns (each rank's partial
update summed by the all-reduce that follows); an adapter's rows are built whole and `rank_rows` cuts them."""

import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import load_file

from pegainfer.errors import CheckpointError, ConfigError, GraphError
from pegainfer.ir.dtypes import FP32, INT32
from pegainfer.ir.graph import REPEAT, Derivation, Graph, Node, Shard, instantiate
from pegainfer.ir.step import LORA_SLOTS
from pegainfer.ir.types import TensorType

if TYPE_CHECKING:
    from pegainfer.frontends.load import LoadedModel

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
    rows: dict[str, np.ndarray] | None = None  # its rows of the tables, once built (read_adapter builds them)


def lora_model(model: "LoadedModel", config: LoraConfig) -> "LoadedModel":
    """The model over its graph with LoRA tables (with_lora): what a GPU engine runs and takes its manifest by."""
    return replace(model, spec=replace(model.spec, graph=with_lora(model.spec.graph, config)))


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
    """One `lora` node per group of target projections reading one input (Q/K/V, gate/up: one shrink of the
    input for all, as their GEMMs merge), its output split into each projection's update and added to it."""
    producers, modules, groups = g.producers(), {}, {}
    for node in g.nodes:
        if (module := _target_module(g, node, producers)) is not None:
            modules[node.name] = module
            groups.setdefault(node.inputs[0], []).append(node)
    types = g.value_types()
    nodes = []
    for node in g.nodes:
        nodes.append(node)
        group = groups.get(node.inputs[0]) if node.op == "linear" else None
        if group is None or node not in group:
            continue
        if node is group[0]:
            nodes += _group_update(g, group, [modules[n.name] for n in group], types, config)
        result, base = node.outputs[0], f"{node.outputs[0]}.base"
        node.outputs = (base,)
        add = Node("add", (base, f"{result}.lora"), (result,), (node.output_types[0],), {})
        types[base] = node.output_types[0]
        nodes.append(add)
    g.nodes = nodes


def _group_update(g: Graph, group: list[Node], modules: list[str], types: dict[str, TensorType],
                  config: LoraConfig) -> list[Node]:
    """The group's tables (named `<parent>.<module>+<module>...`, its projections' `modules`) and its lora node,
    split into updates."""
    parent = modules[0].rpartition(".")[0]
    assert all(m.rpartition(".")[0] == parent for m in modules), f"one input, several parents: {modules}"
    stem = f"{parent}.{'+'.join(m.rpartition('.')[2] for m in modules)}"
    x, outs = types[group[0].inputs[0]], [node.output_types[0].shape[1] for node in group]
    rank = config.max_rank * len(group)
    tables = [f"{stem}.{table}" for table in TABLES]
    g.states[tables[0]] = TensorType(x.dtype, (config.max_loras, rank, x.shape[1]))
    g.states[tables[1]] = TensorType(x.dtype, (config.max_loras, sum(outs), rank))
    g.states[tables[2]] = TensorType(FP32, (config.max_loras,))
    update = f"{stem}.lora"
    lora = Node("lora", (group[0].inputs[0], *tables, LORA_SLOTS), (update,),
                (TensorType(x.dtype, (x.shape[0], sum(outs))),), {})
    updates = tuple(f"{node.outputs[0]}.lora" for node in group)
    if len(group) == 1:
        lora.outputs = updates
        return [lora]
    split = Node("split", (update,), updates, tuple(TensorType(x.dtype, (x.shape[0], n)) for n in outs),
                 {"sizes": tuple(outs)})
    return [lora, split]


def _target_module(g: Graph, node: Node, producers: dict[str, Node]) -> str | None:
    """The weight prefix (`model.layers.{layer}.self_attn.q_proj`) of a linear over a target weight: a plain one,
    one stored in FP8 (the linear then reads its dequantize node's output), or one whose rows the loader regroups
    (a gated attention's q_proj, each head's q and gate rows: the adapter's B rows are regrouped alike,
    `regrouped_rows`)."""
    if node.op != "linear":
        return None
    weight = node.inputs[1]
    if weight not in g.params:
        producer = producers.get(weight)
        weight = producer.inputs[0] if producer is not None and producer.op == "dequantize" else weight
    if weight in g.derived and _regrouping(g.derived[weight]):
        weight = g.derived[weight].sources[0]
        if weight in g.shards:
            raise ConfigError(f"LoRA on {weight.removesuffix('.weight')}, whose rows the loader regroups, under "
                              f"tensor parallelism is not implemented: serve the adapters on one GPU")
    elif weight not in g.params or weight in g.derived:
        return None
    prefix, _, suffix = weight.rpartition(".")
    return prefix if suffix == "weight" and prefix.rpartition(".")[2] in TARGETS else None


def _regrouping(derivation: Derivation) -> bool:
    """Whether a derived weight is one checkpoint tensor's rows in another order (nothing added or dropped)."""
    return bool(derivation.rows) and len(derivation.sources) == 1 and derivation.dequantize is None and \
        sum(stop - start for _, start, stop in derivation.rows) == derivation.source_types[0].shape[0]


def regrouped_rows(graph: Graph) -> dict[str, tuple[tuple[int, int], ...]]:
    """Checkpoint weight (expanded name) -> the row ranges, in order, that the loader regroups it into."""
    return {d.sources[0]: tuple((start, stop) for _, start, stop in d.rows)
            for d in graph.derivations().values() if _regrouping(d)}


@dataclass(frozen=True)
class TableGroup:
    """One lora node's tables: the projections they stack (expanded module names, in order, with their outputs in
    this graph), and the part of the unsharded tables they hold on a rank of a sharded graph: each projection's
    rows of its whole output, and the columns of the whole input (all of both when the graph is not sharded)."""
    stem: str  # the tables' expanded name less `.lora_A`
    modules: tuple[str, ...]
    outs: tuple[int, ...]
    size_in: int
    rows: tuple[tuple[int, int], ...]  # [start, stop) of each projection's whole output that this graph computes
    full_outs: tuple[int, ...]
    columns: tuple[int, int]  # [start, stop) of the whole input that this graph reads
    full_in: int

    @property
    def sharded(self) -> bool:
        return self.full_outs != self.outs or self.full_in != self.size_in


def lora_modules(graph: Graph) -> dict[str, TableGroup]:
    """Every table group of a graph with LoRA tables, by its expanded stem."""
    groups, shards = {}, graph.checkpoint_shards()
    for g, layer in graph.instances():
        for name, t in g.states.items():
            if not name.endswith(".lora_A"):
                continue
            stem = name[:-len(".lora_A")] if layer is None else instantiate(name[:-len(".lora_A")], layer)
            parent, _, members = stem.rpartition(".")
            modules = tuple(f"{parent}.{m}" for m in members.split("+"))
            split = next((n for n in g.nodes if n.op == "split" and n.inputs[0] == name[:-len(".lora_A")] + ".lora"),
                         None)
            outs = tuple(split.attrs["sizes"]) if split else (g.states[name[:-1] + "B"].shape[1],)
            groups[stem] = _group_part(stem, modules, outs, t.shape[2], shards)
    return groups


def _group_part(stem: str, modules: tuple[str, ...], outs: tuple[int, ...], size_in: int,
                shards: dict[str, Shard]) -> TableGroup:
    """A group with the part of the whole projections its rank computes, read off the slices of their weights
    (Graph.shards): rows of the output where a weight is cut along axis 0, columns of the input along axis 1."""
    rows, full_outs, columns = [], [], set()
    for module, out in zip(modules, outs):
        shard = shards.get(f"{module}.weight")
        along_rows = shard is not None and shard.axis == 0
        if shard is not None and (shard.pad or shard.axis not in (0, 1) or
                                  along_rows and shard.stop - shard.start != out):
            raise GraphError(f"LoRA on {module}: its weight is sliced as {shard}, expected {out} rows or some "
                             f"columns, without padding")
        rows.append((shard.start, shard.stop) if along_rows else (0, out))
        full_outs.append(shard.full.shape[0] if along_rows else out)
        along_columns = shard is not None and shard.axis == 1
        columns.add((shard.start, shard.stop, shard.full.shape[1]) if along_columns else (0, size_in, size_in))
    if len(columns) != 1:
        raise GraphError(f"LoRA tables {stem}: projections of one input read different columns of it "
                         f"({sorted(columns)})")
    ((start, stop, full_in),) = columns
    return TableGroup(stem, modules, outs, size_in, tuple(rows), tuple(full_outs), (start, stop), full_in)


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
    modules = {module: (group.full_in, out) for group in lora_modules(graph).values()  # the checkpoint's sizes
               for module, out in zip(group.modules, group.full_outs)}
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
    adapter.rows = adapter_rows(adapter, graph)  # here, off the engine's thread: a swap into a slot only copies
    adapter.modules.clear()
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
    """An adapter's rows of every table of `graph`, by expanded table name, in the tables' dtypes: what an engine
    writes into one slot (those built already where the adapter has them). A group's A stacks its projections' A
    (each padded to the tables' rank), its B holds each projection's B on the diagonal: its outputs' rows, its
    rank's columns; a projection the adapter leaves alone stays zero. On a sharded graph these are the unsharded
    tables' rows (the same on every rank), which each rank cuts to its part with `rank_rows`."""
    if adapter is not None and adapter.rows is not None:
        return adapter.rows
    writes, states, regrouped = {}, graph.expanded_states(), regrouped_rows(graph)
    for stem, group in lora_modules(graph).items():
        width = states[f"{stem}.lora_A"].shape[1]  # the tables' rank for each projection of the group
        table_a = np.zeros((width, group.full_in), np.float32)
        table_b = np.zeros((sum(group.full_outs), width), np.float32)
        rank = width // len(group.modules)
        found = False
        for index, (module, start) in enumerate(zip(group.modules, np.cumsum((0, *group.full_outs[:-1])))):
            a, b = adapter.modules.get(module, (None, None)) if adapter else (None, None)
            if a is None:
                continue
            found = True
            if f"{module}.weight" in regrouped:  # its outputs in the order the loader regroups the weight's rows
                b = np.concatenate([b[start:stop] for start, stop in regrouped[f"{module}.weight"]])
            table_a[index * rank:index * rank + a.shape[0]] = a
            table_b[start:start + b.shape[0], index * rank:index * rank + b.shape[1]] = b
        for name, table in ((f"{stem}.lora_A", table_a), (f"{stem}.lora_B", table_b)):
            writes[name] = table.astype(states[name].dtype.np_dtype, copy=False)
        writes[f"{stem}.lora_scale"] = np.float32(adapter.scale if found else 0.0)
    return writes


def rank_rows(rows: dict[str, np.ndarray], graph: Graph) -> dict[str, np.ndarray]:
    """The part of an adapter's rows (adapter_rows: the unsharded tables') that a rank's tables hold: each
    column-parallel projection's rows of B, cut as its weight's rows are (the same rows of each block where Q/K/V
    or gate/up stack), and a row-parallel projection's columns of A, cut as its weight's columns are; the rows of
    tables `graph` holds whole (all of them where it is not sharded) as they are."""
    cut = dict(rows)
    for stem, group in lora_modules(graph).items():
        if not group.sharded:
            continue
        a, b = rows[f"{stem}.lora_A"], rows[f"{stem}.lora_B"]
        if a.shape[1] != group.full_in or b.shape[0] != sum(group.full_outs):
            raise GraphError(f"LoRA rows of {stem}: expected the unsharded tables' A [*, {group.full_in}] and B "
                             f"[{sum(group.full_outs)}, *], found {list(a.shape)} and {list(b.shape)}")
        cut[f"{stem}.lora_A"] = np.ascontiguousarray(a[:, slice(*group.columns)])
        starts = np.cumsum((0, *group.full_outs[:-1]))
        cut[f"{stem}.lora_B"] = np.concatenate([b[base + start:base + stop]
                                                for base, (start, stop) in zip(starts, group.rows)])
    return cut
