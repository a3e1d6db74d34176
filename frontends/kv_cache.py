"""`--kv-cache-dtype fp8`: the KV cache stored as float8 e4m3, which halves its bytes (twice the tokens in the same
memory, half the reads of decode attention). Each layer's keys and values carry a float32 scale (ir/ops/attention.py):
the checkpoint's `<attention>.k_scale` / `v_scale` where it has them (calibrated by llm-compressor or ModelOpt),
otherwise 1.0, as vLLM does."""

import numpy as np

from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.ir.dtypes import F8E4M3, FP32
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.types import TensorType

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8 is e4m3 (vLLM's spellings)
SCALE_NAMES = ("k_scale", "v_scale")
DEFAULT_SCALE = 1.0


def apply_kv_cache_dtype(graph: Graph, kv_cache_dtype: str) -> Graph:
    """The graph with its KV states retyped as `kv_cache_dtype` (KV_CACHE_DTYPES), each write and read of an FP8
    cache given the layer's two scales as params that default to 1.0."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return graph
    if any(n.op == "latent_write" for g in graph.all_graphs() for n in g.nodes):
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: an FP8 latent attention cache is not implemented; "
                          f"use --kv-cache-dtype auto (the latent cache is already a fraction of per-head keys)")
    for g in graph.all_graphs():
        for write in [n for n in g.nodes if n.op == "kv_write"]:
            _store_fp8(g, write)
    return graph


def has_fp8_cache(graph: Graph) -> bool:
    return any(t.dtype.name.startswith("f8") for g in graph.all_graphs() for t in g.states.values())


def kv_cache_summary(graph: Graph) -> str:
    """A token's bytes in the KV cache over all layers; for latent attention, the values a layer caches against the
    per-head keys and values the same heads would cache."""
    states = [t for name, t in graph.expanded_states().items() if t.shape[0] == "num_blocks"]
    nbytes = sum(int(np.prod(t.shape[2:])) * t.dtype.itemsize for t in states)
    line = f"KV cache: {nbytes} bytes a token over {len(states)} cache tensors"
    for g in graph.all_graphs():
        mla = next((n for n in g.nodes if n.op == "mla_attention"), None)
        if mla is not None:
            types = g.value_types()
            heads, nope = types[mla.inputs[0]].shape[1:]
            per_head = heads * (nope + types[mla.inputs[1]].shape[2] + mla.output_types[0].shape[2])
            latent = types[mla.inputs[2]].shape[3]
            return (f"{line}; latent attention: {latent} values a token a layer, where per-head keys and values "
                    f"would be {per_head} ({per_head / latent:.1f}x)")
    return line


def _store_fp8(g: Graph, write: Node) -> None:
    prefix = _attention_prefix(g, write)
    scales = tuple(f"{prefix}.{name}" for name in SCALE_NAMES)
    for name in scales:
        g.params[name] = TensorType(FP32, (1,))
        g.defaults[name] = DEFAULT_SCALE
    for state in write.inputs[:2]:
        g.states[state] = TensorType(F8E4M3, g.states[state].shape)
    write.inputs = (*write.inputs, *scales)
    write.output_types = tuple(TensorType(F8E4M3, t.shape) for t in write.output_types)
    for reader in g.nodes:
        if reader.op == "paged_attention" and reader.inputs[1:3] == write.outputs:
            reader.inputs = (*reader.inputs, *scales)


def _attention_prefix(g: Graph, write: Node) -> str:
    """The attention module whose keys the write stores (`model.layers.{layer}.self_attn`), from its k_proj weight:
    the keys' producers followed back to their projection."""
    producers = g.producers()
    node = producers.get(write.inputs[2])
    while node is not None and node.op != "linear":
        node = producers.get(node.inputs[0])
    weight = node.inputs[1] if node is not None else ""
    if weight in producers and producers[weight].op == "dequantize":
        weight = producers[weight].inputs[0]
    if not weight.endswith(".k_proj.weight"):
        raise ConfigError(f"--kv-cache-dtype fp8: the keys of {write.name} come from no k_proj weight (found "
                          f"{weight or 'no projection'}), so their checkpoint scales cannot be named")
    return weight.removesuffix(".k_proj.weight")


def check_kv_scales(values: dict[str, np.ndarray], source: str) -> None:
    """A checkpoint's cache scales must be positive and finite: a stored value is the key divided by its scale."""
    for name, value in values.items():
        scale = float(np.asarray(value, np.float32).reshape(-1)[0])
        if not (np.isfinite(scale) and scale > 0):
            raise CheckpointError(f"{source}: tensor {name!r} is {scale}, expected a positive finite KV-cache scale")
