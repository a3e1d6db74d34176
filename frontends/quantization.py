"""FP8 checkpoints: config.json's `quantization_config` read and checked, and the graph rewritten to read what the
checkpoint stores: each projection's weight as float8 e4m3 with its scales, turned into the model's dtype by a
`dequantize` node before its GEMM (ir/ops/quantize.py). quant_method `fp8` (the model makers' own FP8
checkpoints) stores a float32 `weight_scale_inv` per 128 x 128 block; llm-compressor's FP8_DYNAMIC is
compressed-tensors with a `weight_scale` per output channel. The LM head, the embedding and the modules the config
leaves out stay as they are. On the GPU the dequantize folds into its GEMM (passes/fusion.py), from sm_89 on."""

import re
from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.kv_cache import has_fp8_cache
from pegainfer.ir.dtypes import F8E4M3, FP32, DType
from pegainfer.ir.graph import Derivation, Graph, Node
from pegainfer.ir.ops.quantize import scale_shape
from pegainfer.ir.types import TensorType
from pegainfer.passes.rewrite import fresh_name

FP8_MAX = 448.0  # the largest float8 e4m3fn
FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
COMPRESSED_KEYS = {"quant_method", "config_groups", "format", "ignore", "kv_cache_scheme", "quantization_status",
                   "global_compression_ratio", "version", "sparsity_config"}
# compressed-tensors' FP8_DYNAMIC (llm-compressor): what its one config group must say, key by key
FP8_DYNAMIC_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_DYNAMIC_INPUTS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
# a calibrated FP8 KV cache: a static scale per layer for keys and one for values (`self_attn.k_scale`, `v_scale`),
# which `--kv-cache-dtype fp8` applies (frontends/kv_cache.py)
FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}


@dataclass(frozen=True)
class Fp8Weights:
    block: tuple[int, int] | None  # the rows and columns one scale covers; None: a row each (per channel)
    scale_suffix: str  # the scale tensor's name beside each weight: "_scale_inv" (fp8) or "_scale"
    skipped: tuple[str, ...] = ()  # module names (or "re:" patterns) whose projections stay unquantized

    def block_of(self, shape: tuple[int, int]) -> tuple[int, int]:
        return self.block or (1, shape[1])

    def skips(self, module: str) -> bool:
        return any(re.fullmatch(m[3:], module) if m.startswith("re:") else module == m or module.endswith("." + m)
                   for m in self.skipped)


def read_quantization(raw: dict, source: str) -> Fp8Weights | None:
    """config.json's quantization_config, or None without one: quant_method fp8 (block scales) or
    compressed-tensors FP8_DYNAMIC (a scale per output channel). A method or option not implemented is refused,
    naming the key. Activations stay unquantized: dynamic activation scales are the kernels' choice to make."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, found {config!r}")
    method = config.get("quant_method")
    if method == "fp8":
        return _read_fp8(config, source)
    if method == "compressed-tensors":
        return _read_compressed(config, source)
    raise ConfigError(f"{source}: quantization_config.quant_method {method!r} is not implemented (implemented: "
                      f"'fp8' with block scales, 'compressed-tensors' FP8_DYNAMIC)")


def _read_fp8(config: dict, source: str) -> Fp8Weights:
    _refuse_unknown(config, FP8_KEYS, source)
    if config.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{source}: quantization_config.fmt {config['fmt']!r} is not implemented (e4m3 only)")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{source}: quantization_config.activation_scheme {config['activation_scheme']!r} is not "
                          f"implemented (dynamic only)")
    block = config.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{source}: quantization_config.weight_block_size is missing: per-tensor FP8 scales are "
                          f"not implemented")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConfigError(f"{source}: quantization_config.weight_block_size must be two positive integers, "
                          f"found {block!r}")
    return Fp8Weights((block[0], block[1]), "_scale_inv", _names(config, "modules_to_not_convert", source))


def _read_compressed(config: dict, source: str) -> Fp8Weights:
    _refuse_unknown(config, COMPRESSED_KEYS, source)
    for key, wanted in (("format", "float-quantized"), ("quantization_status", "compressed")):
        if config.get(key, wanted if key == "quantization_status" else None) != wanted:
            raise ConfigError(f"{source}: quantization_config.{key} {config.get(key)!r} is not implemented "
                              f"(expected {wanted!r})")
    if config.get("sparsity_config"):
        raise ConfigError(f"{source}: quantization_config.sparsity_config is not implemented")
    kv_scheme = config.get("kv_cache_scheme") or {}
    if not isinstance(kv_scheme, dict):
        raise ConfigError(f"{source}: quantization_config.kv_cache_scheme must be an object, found {kv_scheme!r}")
    for key, value in FP8_KV_SCHEME.items() if kv_scheme else ():
        if kv_scheme.get(key) != value:
            raise ConfigError(f"{source}: quantization_config.kv_cache_scheme.{key} {kv_scheme.get(key)!r} is not "
                              f"implemented (a static FP8 scale per layer: {value!r})")
    groups = config.get("config_groups")
    if not (isinstance(groups, dict) and len(groups) == 1):
        raise ConfigError(f"{source}: quantization_config.config_groups must hold one group (FP8_DYNAMIC), found "
                          f"{len(groups) if isinstance(groups, dict) else groups!r}")
    (name, group), = groups.items()
    where = f"quantization_config.config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise ConfigError(f"{source}: {where}.targets {group.get('targets')!r} is not implemented (['Linear'])")
    for part, wanted in (("weights", FP8_DYNAMIC_WEIGHTS), ("input_activations", FP8_DYNAMIC_INPUTS)):
        scheme = group.get(part) or {}
        for key, value in wanted.items():
            if scheme.get(key) != value:
                raise ConfigError(f"{source}: {where}.{part}.{key} {scheme.get(key)!r} is not implemented "
                                  f"(FP8_DYNAMIC: {value!r})")
    if group.get("output_activations") is not None:
        raise ConfigError(f"{source}: {where}.output_activations is not implemented")
    return Fp8Weights(None, "_scale", _names(config, "ignore", source))


def _refuse_unknown(config: dict, known: set[str], source: str) -> None:
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"{source}: quantization_config.{unknown[0]} is not implemented for quant_method "
                          f"{config['quant_method']!r}")


def _names(config: dict, key: str, source: str) -> tuple[str, ...]:
    names = config.get(key) or []
    if not (isinstance(names, list) and all(isinstance(m, str) for m in names)):
        raise ConfigError(f"{source}: quantization_config.{key} must be a list of module names, found {names!r}")
    return tuple(names)


ONLINE = Fp8Weights(None, "_scale")  # `--quantization fp8`: a bf16 checkpoint's projections quantized at load
QUANTIZATION_CHOICES = ("fp8",)


def scheme_for(raw: dict, source: str, quantization: str | None) -> Fp8Weights | None:
    """The weights' FP8 scheme: the checkpoint's own, or with `--quantization fp8` a scale per output channel the
    loader computes (the embedding and LM head left as stored); a checkpoint quantized already refuses the flag."""
    stored = read_quantization(raw, source)
    if quantization is None:
        return stored
    if quantization not in QUANTIZATION_CHOICES:
        raise ConfigError(f"--quantization {quantization}: expected one of {', '.join(QUANTIZATION_CHOICES)}")
    if stored is not None:
        raise ConfigError(f"--quantization {quantization}: {source} is quantized already (its quantization_config "
                          f"says so); leave the flag out")
    return ONLINE


def quantize_graph(graph: Graph, scheme: Fp8Weights, dtype: DType) -> Graph:
    """Every projection weight stored as FP8 with its scales, as the checkpoint makers quantize: a linear's (but the
    LM head's and a router's, whose scores stay exact) dequantized to `dtype` before its GEMM, a latent attention's
    kv_b the same, and a MoE layer's stacked experts read as FP8 by their op."""
    head = graph.producers().get(graph.outputs[0])
    for g in graph.all_graphs():
        routers = {n.inputs[0] for n in g.nodes if n.op == "moe_route"}
        for node in list(g.nodes):
            if node.op == "moe_experts":
                _quantize_experts(g, node, scheme)
                continue
            index = {"linear": 1, "mla_attention": 3}.get(node.op)
            if index is None or node is head or node.inputs[index] not in g.params or node.outputs[0] in routers:
                continue
            weight = node.inputs[index]
            if scheme.skips(_module_of(g.derived[weight].sources[0] if weight in g.derived else weight)):
                continue
            if weight in g.derived:
                _quantize_regrouped(g, weight, scheme)
            _dequantize_before(g, node, index, scheme, dtype)
    return graph


def _quantize_regrouped(g: Graph, weight: str, scheme: Fp8Weights) -> None:
    """A weight made at load from row ranges of one checkpoint tensor (a gated attention's q_proj, its heads' q
    and gate rows regrouped) taken from its FP8 source, its scales from the same rows of the source's: each range
    must cover whole blocks of scale rows."""
    derivation = g.derived[weight]
    if derivation.dequantize is not None or not derivation.rows or len(derivation.sources) != 1:
        raise ConfigError(f"FP8 weights: {weight} is made at load from {', '.join(derivation.sources)}, which FP8 "
                          f"checkpoints do not support")
    (source,), (source_type,) = derivation.sources, derivation.source_types
    block = scheme.block_of(source_type.shape)
    rows = block[0]
    if any(start % rows or stop % rows for _, start, stop in derivation.rows):
        raise ConfigError(f"FP8 weights: {weight} is made at load from rows of {source} that do not keep its "
                          f"{rows}-row scale blocks whole, which FP8 checkpoints do not support")
    g.derived[weight] = Derivation((source,), (TensorType(F8E4M3, source_type.shape),), 0, derivation.rows)
    g.derived[weight + scheme.scale_suffix] = Derivation(
        (source + scheme.scale_suffix,), (TensorType(FP32, scale_shape(source_type.shape, block)),), 0,
        tuple((index, start // rows, stop // rows) for index, start, stop in derivation.rows))


def _quantize_experts(g: Graph, node: Node, scheme: Fp8Weights) -> None:
    """The stacked experts' weights as their FP8 sources, with the sources' scales stacked beside them. Scales per
    output row take blocks of one row and the wider projection's columns, so that gate_up and down share them."""
    widest = max(g.derived[node.inputs[i]].source_types[0].shape[1] for i in (3, 4))
    blocks = set()
    for index in (3, 4):
        stacked = node.inputs[index]
        derivation = g.derived[stacked]
        if any(scheme.skips(_module_of(source)) for source in derivation.sources):
            raise ConfigError(f"FP8 weights: {stacked}'s experts are partly left unquantized "
                              f"(modules_to_not_convert), which the FP8 expert kernels do not take")
        source_type = derivation.source_types[0]
        block = scheme.block or (1, widest)
        scale_type = TensorType(FP32, scale_shape(source_type.shape, block))
        count = len(derivation.sources)
        g.params[stacked] = TensorType(F8E4M3, g.params[stacked].shape)
        g.derived[stacked] = Derivation(derivation.sources, (TensorType(F8E4M3, source_type.shape),) * count)
        scale = fresh_name(g, stacked + scheme.scale_suffix)
        g.params[scale] = TensorType(FP32, (count * scale_type.shape[0], scale_type.shape[1]))
        g.derived[scale] = Derivation(tuple(s + scheme.scale_suffix for s in derivation.sources), (scale_type,) * count)
        node.inputs = (*node.inputs, scale)
        blocks.add(tuple(block))
    assert len(blocks) == 1, f"{node.name}: gate_up and down quantized in different blocks {blocks}"
    node.attrs = {**node.attrs, "block": list(blocks.pop())}


def is_quantized(graph: Graph) -> bool:
    return any(n.op == "dequantize" for g in graph.all_graphs() for n in g.nodes)


FP8_MIN_SM = 89  # the first SM with FP8 conversions (and tensor cores): Ada, then Hopper


def refuse_fp8_below(graph: Graph, sms: list[int]) -> None:
    """FP8 weights or an FP8 KV cache on the GPU need sm_89 or newer: the kernels convert them in registers with
    its instructions."""
    older = [sm for sm in sms if sm < FP8_MIN_SM]
    if older and is_quantized(graph):
        raise ConfigError(f"FP8 weights need sm_{FP8_MIN_SM} or newer (FP8 conversions); found sm_{older[0]}: run "
                          f"the bf16 checkpoint there, or this one with --device cpu")
    if older and has_fp8_cache(graph):
        raise ConfigError(f"--kv-cache-dtype fp8 needs sm_{FP8_MIN_SM} or newer (FP8 conversions); found "
                          f"sm_{older[0]}: use --kv-cache-dtype auto there")


def _module_of(weight: str) -> str:
    return re.sub(r"\.weight$", "", weight)


def _dequantize_before(g: Graph, consumer: Node, index: int, scheme: Fp8Weights, dtype: DType) -> None:
    weight = consumer.inputs[index]
    stored = g.params[weight]
    g.params[weight] = TensorType(F8E4M3, stored.shape)
    scale = weight + scheme.scale_suffix
    block = scheme.block_of(stored.shape)
    g.params[scale] = TensorType(FP32, scale_shape(stored.shape, block))
    value = fresh_name(g, _module_of(weight).split(".")[-1] + ".dequantized")
    attrs = {"block": list(block), "dtype": dtype.name}
    node = Node("dequantize", (weight, scale), (value,), (TensorType(dtype, stored.shape),), attrs)
    g.nodes.insert(g.nodes.index(consumer), node)
    consumer.inputs = (*consumer.inputs[:index], value, *consumer.inputs[index + 1:])
