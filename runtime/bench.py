"""`pegainfer bench`: decode ms/step by batch and context, and time to first token of one prompt, on the GPU,
each against the memory or tensor-core floor. A model without weights (an embedded config or a config.json)
gets random bf16 weights (or FP8 ones, with --quantization fp8): speed does not depend on the values."""

import time
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path

import ml_dtypes
import numpy as np

from pegainfer.frontends.load import LoadedModel, ModelSpec, load_model, load_spec, resolve_config_path
from pegainfer.ir.dtypes import F8E4M3
from pegainfer.ir.graph import instantiate
from pegainfer.ir.step import SLOT_POOL
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.gpu.engine import EngineOptions, GpuEngine

HBM_BYTES_PER_S = 4.29e12  # H200 device-to-device copy, measured (shared/reference/H200.md)
TENSOR_FLOP_PER_S = 790e12  # H200 bf16 matmul through PyTorch, measured (same page)
FP8_TENSOR_FLOP_PER_S = 2 * TENSOR_FLOP_PER_S  # Hopper's e4m3 tensor cores: twice bf16's rate (peak to peak)
WARMUP = 3


@dataclass
class DecodeRow:
    graphs: bool
    batch: int
    context: int
    ms_per_step: float
    tokens_per_s: float
    floor_ms: float
    achieved_tb_per_s: float


@dataclass
class PrefillRow:
    prompt_tokens: int
    ttft_ms: float
    floor_ms: float


def bench_model(model: str, quantization: str | None = None, kv_cache_dtype: str = "auto") -> LoadedModel:
    """A checkpoint folder as it is; an embedded config or a config.json with random bf16 weights (with
    `quantization`, random FP8 projections and their scales)."""
    path = Path(model)
    options = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return load_model(path, lazy=True, device="cuda", **options)
    spec = load_spec(resolve_config_path(model), device="cuda", **options)
    return LoadedModel(spec, path, random_weights(spec))


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights of about 0.02: bf16 values, or FP8 ones of about 64 times scales of 0.02 / 64."""
    normal = np.random.default_rng(seed).standard_normal(1 << 24).astype(np.float32)
    block = (normal * 0.02).astype(ml_dtypes.bfloat16)
    fp8 = np.clip(normal * 64, -448, 448).astype(F8E4M3.np_dtype)
    scales = scale_params(spec)
    weights = {}
    defaults = spec.graph.param_defaults()
    for name, t in spec.graph.checkpoint_params().items():
        if name in defaults:
            weights[name] = np.full(t.shape, defaults[name], t.dtype.np_dtype)
        elif t.dtype == F8E4M3:
            weights[name] = _tiled(fp8, t.shape)
        elif name in scales:
            weights[name] = np.full(t.shape, 0.02 / 64, np.float32)
        else:
            weights[name] = _tiled(block, t.shape).astype(t.dtype.np_dtype, copy=False)
    return weights


def _tiled(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`values` repeated to `shape`; a tensor no larger is a view of them (np.resize would keep a copy of all of
    `values` behind each small tensor: 32 MB apiece for thousands of experts)."""
    size = prod(shape)
    return values[:size].reshape(shape) if size <= values.size else np.resize(values, shape)


def scale_params(spec: ModelSpec) -> set[str]:
    """The checkpoint's FP8 scale tensors (what each dequantize reads besides its values)."""
    return {value if layer is None else instantiate(value, layer) for g, layer in spec.graph.instances()
            for n in g.nodes if n.op == "dequantize" for value in n.inputs[1:]}


def weight_bytes(spec: ModelSpec, batch: int | None = None) -> float:
    """The weights a decode step of `batch` tokens reads: all of them, but of each routed expert its expected share
    (None: every expert)."""
    shares = routed_shares(spec, batch) if batch is not None else {}
    return sum(prod(t.shape) * t.dtype.itemsize * shares.get(name, 1.0)
               for name, t in spec.graph.checkpoint_params().items())


def routed_shares(spec: ModelSpec, tokens: int | None) -> dict[str, float]:
    """Each routed expert tensor's expected share of use: at decode of `tokens` tokens the chance some token picks
    its expert, 1 - (1 - k / E)^tokens, under uniform routing (random weights route about so); for a prefill
    (None) k / E, the share of the tokens it multiplies."""
    derivations = spec.graph.derivations()
    shares = {}
    for graph, layer in spec.graph.instances():
        types = graph.value_types()
        for node in graph.nodes:
            if node.op != "moe_experts":
                continue
            picked = types[node.inputs[2]].shape[1] / node.attrs["experts"]
            share = picked if tokens is None else 1 - (1 - picked) ** tokens
            for stacked in node.inputs[3:5]:
                name = stacked if layer is None else instantiate(stacked, layer)
                sources = derivations[name].sources if name in derivations else (name,)
                shares.update(dict.fromkeys(sources, share))
    return shares


def kv_bytes_per_token(spec: ModelSpec) -> int:
    return sum(prod(t.shape[2:]) * t.dtype.itemsize for t in spec.graph.expanded_states().values()
               if t.shape[0] != SLOT_POOL)


def state_bytes_per_sequence(spec: ModelSpec) -> int:
    """A sequence's rows of the recurrent state pools (none for attention-only models)."""
    return sum(prod(t.shape[1:]) * t.dtype.itemsize for t in spec.graph.expanded_states().values()
               if t.shape[0] == SLOT_POOL)


def bench_decode(engine: GpuEngine, batches: list[int], contexts: list[int], steps: int = 20,
                 graphs: bool = True) -> list[DecodeRow]:
    spec = engine.model.spec
    rows = []
    for batch in batches:
        for context in contexts:
            engine.options.cuda_graphs = graphs
            seqs = _sequences(engine, batch, context, steps + WARMUP)
            times = []
            for step in range(steps + WARMUP):
                began = time.perf_counter()
                engine.run([Chunk(s, 1) for s in seqs])
                engine.ctx.synchronize()
                if step >= WARMUP:
                    times.append(time.perf_counter() - began)
            for seq in seqs:
                engine.release(seq)
            ms = float(np.median(times) * 1e3)
            moved = weight_bytes(spec, batch) + batch * ((context + steps // 2) * kv_bytes_per_token(spec)
                                                  + 2 * state_bytes_per_sequence(spec))  # states read and written
            rows.append(DecodeRow(graphs, batch, context, ms, batch / ms * 1e3, moved / HBM_BYTES_PER_S * 1e3,
                                  moved / ms / 1e9))
    return rows


def _sequences(engine: GpuEngine, batch: int, context: int, steps: int) -> list[Sequence]:
    """Sequences whose first `context` tokens count as cached (their KV content does not matter for speed), each
    of random tokens of its own: a MoE routes their rows apart, as it would distinct requests'."""
    vocab = engine.model.spec.config.vocab_size
    seqs = [Sequence(i, np.random.default_rng(i).integers(0, vocab, context + steps + 1).tolist())
            for i in range(batch)]
    for seq in seqs:
        engine.allocator.grow(seq.table, context)
        seq.num_cached = context
    return seqs


def bench_prefill(engine: GpuEngine, prompt_lengths: list[int], repeats: int = 3) -> list[PrefillRow]:
    """Time to first token: one prompt's prefill step, from its upload to its logits on the host."""
    spec = engine.model.spec
    rows = []
    for length in prompt_lengths:
        times = []
        for _ in range(repeats + 1):
            seq = Sequence(0, list(np.random.default_rng(length).integers(0, spec.config.vocab_size, length)))
            began = time.perf_counter()
            engine.step([Chunk(seq, length)])
            times.append(time.perf_counter() - began)
            engine.release(seq)
        rows.append(PrefillRow(length, float(np.median(times[1:]) * 1e3), prefill_floor_ms(spec, length)))
    return rows


def prefill_floor_ms(spec: ModelSpec, tokens: int) -> float:
    """The prefill's flops at the tensor cores' rate: its FP8 projections' at the e4m3 rate, the rest at bf16's."""
    fp8 = fp8_gemm_flops(spec, tokens)
    return ((prefill_flops(spec, tokens) - fp8) / TENSOR_FLOP_PER_S + fp8 / FP8_TENSOR_FLOP_PER_S) * 1e3


def fp8_gemm_flops(spec: ModelSpec, tokens: int) -> float:
    """2 x weights x tokens of the projections that multiply in e4m3: those stored so, less the routed experts
    (Triton's MoE kernels widen them to the activations' dtype) and weights dequantized before use (MLA's kv_b)."""
    shares = routed_shares(spec, None)
    widened = {source for d in spec.graph.derivations().values() if d.dequantize is not None for source in d.sources}
    return sum(2 * prod(t.shape) * tokens for name, t in spec.graph.checkpoint_params().items()
               if t.dtype == F8E4M3 and name not in shares and name not in widened)


def prefill_flops(spec: ModelSpec, tokens: int) -> float:
    """2 x weights x tokens for the GEMMs (the LM head for the last token only) plus causal attention in the layers
    with a KV cache (recurrent layers' scans are left out, as small beside their projections); weights
    counted by element (an FP8 projection's scales left out), so FP8 and bf16 steps do the same flops; a routed
    expert's by the share of the tokens it takes."""
    config = spec.config
    head = config.vocab_size * config.hidden_size
    scales, shares = scale_params(spec), routed_shares(spec, None)
    weights = sum(prod(t.shape) * shares.get(name, 1.0) for name, t in spec.graph.checkpoint_params().items()
                  if name not in scales)
    gemm = 2 * (weights - head) * tokens + 2 * head
    caches = [t for t in spec.graph.expanded_states().values() if t.shape[0] != SLOT_POOL]  # a K and a V a layer
    attention = sum(2 * config.num_attention_heads * t.shape[-1] * tokens ** 2 / 2 for t in caches)
    return gemm + attention


def kernel_breakdown(engine: GpuEngine, context: int) -> dict[str, float]:
    """Microseconds per batch-1 decode step in each launch kind (summed over layers), from CUDA events around
    every launch of an eager step (the events add gaps of their own)."""
    (seq,) = _sequences(engine, 1, context, 2)
    engine.options.cuda_graphs = False
    engine.run([Chunk(seq, 1)])
    engine.executor.profile = []
    engine.run([Chunk(seq, 1)])
    engine.ctx.synchronize()
    totals: dict[str, float] = {}
    for name, start, end in engine.executor.profile:
        totals[name] = totals.get(name, 0.0) + end.seconds_since(start) * 1e6
    engine.executor.profile = None
    engine.release(seq)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def format_decode(rows: list[DecodeRow]) -> str:
    lines = [f"{'mode':<7} {'batch':>5} {'context':>7} {'ms/step':>8} {'tok/s':>8} {'floor ms':>8} {'share':>5} "
             f"{'TB/s':>5}"]
    lines += [f"{'graphs' if r.graphs else 'eager':<7} {r.batch:>5} {r.context:>7} {r.ms_per_step:>8.2f} "
              f"{r.tokens_per_s:>8.0f} {r.floor_ms:>8.2f} {r.floor_ms / r.ms_per_step:>5.0%} "
              f"{r.achieved_tb_per_s:>5.2f}" for r in rows]
    return "\n".join(lines) + "\n"


def format_prefill(rows: list[PrefillRow]) -> str:
    lines = [f"{'prompt':>7} {'TTFT ms':>8} {'floor ms':>8}"]
    lines += [f"{r.prompt_tokens:>7} {r.ttft_ms:>8.1f} {r.floor_ms:>8.1f}" for r in rows]
    return "\n".join(lines) + "\n"


def as_json(rows) -> list[dict]:
    return [asdict(r) for r in rows]


def engine_for(model: LoadedModel, manifest: Path, *, max_tokens: int, max_batch: int,
               max_model_len: int) -> GpuEngine:
    return GpuEngine(model, manifest, EngineOptions(max_tokens=max_tokens, max_batch=max_batch,
                                                    max_model_len=max_model_len,
                                                    kv_tokens=max_batch * max_model_len))


def random_engine(name: str, *, max_tokens: int, max_batch: int, max_model_len: int) -> GpuEngine:
    """A GPU engine of the named model's random weights (bench_model), its kernels compiled where missing: what
    the GPU check scripts measure on."""
    from pegainfer.runtime.device import visible_sm
    from pegainfer.runtime.gpu.start import ensure_manifest

    model = bench_model(name)
    manifest = ensure_manifest(model.spec, visible_sm(), None, label=name)
    return engine_for(model, manifest, max_tokens=max_tokens, max_batch=max_batch, max_model_len=max_model_len)
