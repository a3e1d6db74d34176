"""What the GPU runtime does that needs no GPU: argument packing by the manifest ABI, grid rules, device views,
decode buckets and padding, the reserved padding block, the rule that serving imports no compiler, and the
refusal of a manifest compiled from another lowering of the model."""

import ctypes
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pegainfer.backends.cache import sha256_of
from pegainfer.backends.manifest import Launch, Manifest, check_lowering, dump, graph_digest, pipeline_digest
from pegainfer.backends.spec import GridDim, Param, ParamKind, pick_variant
from pegainfer.errors import PegainferError
from pegainfer.ir import BF16, INT32
from pegainfer.ir.graph import REPEAT
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.engine import StepPlan, bucket_for, decode_buckets
from pegainfer.runtime.gpu.executor import GpuExecutor, Limits
from pegainfer.runtime.gpu.launch import pack_launch, shape_of
from pegainfer.runtime.gpu.memory import kv_blocks_for_memory
from pegainfer.runtime.gpu.step_padding import PADDING_BLOCK, pad_decode_step
from pegainfer.runtime.kv_blocks import BlockAllocator


class StandInEvent:
    """driver.Event without a device: every copy it marks is done at once."""
    def __init__(self, timing: bool = True) -> None:
        pass

    def record(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_arguments_are_packed_in_abi_order_with_the_right_types():
    tensors = {"x": DeviceTensor(0x7000, (5, 64), BF16, 192), "rows": DeviceTensor(0x9000, (3,), INT32, 1)}
    params = [Param("x_ptr", ParamKind.TENSOR, "x", "*bf16"), Param("rows_ptr", ParamKind.TENSOR, "rows", "*i32"),
              Param("M", ParamKind.DIM, "tokens", "i32"), Param("stride_x", ParamKind.STRIDE, "x", "i32"),
              Param("global_scratch", ParamKind.SCRATCH, "0", "*i8"),
              Param("profile_scratch", ParamKind.SCRATCH, "0", "*i8")]
    packed = pack_launch(params, tensors, {"tokens": 5})
    assert [type(v) for v in packed.values] == [ctypes.c_uint64] * 2 + [ctypes.c_int32] * 2 + [ctypes.c_uint64] * 2
    assert [v.value for v in packed.values] == [0x7000, 0x9000, 5, 192, 0, 0]
    pointers = (ctypes.c_void_p * 6).from_address(packed.address)
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0x7000
    assert ctypes.c_int32.from_address(pointers[3]).value == 192


def test_a_skipping_pointer_starts_that_many_rows_into_its_tensor():
    """A mixed step's chunk tiles read the per-sequence tensors from the first sequence after the decode rows."""
    tensors = {"tables": DeviceTensor(0x8000, (6, 10), INT32, 12), "lens": DeviceTensor(0x9000, (6,), INT32, 1)}
    params = [Param("T", ParamKind.TENSOR, "tables", "*i32", skip="decode_seqs"),
              Param("L", ParamKind.TENSOR, "lens", "*i32", skip="decode_seqs"),
              Param("L0", ParamKind.TENSOR, "lens", "*i32")]
    packed = pack_launch(params, tensors, {"decode_seqs": 4})
    assert [v.value for v in packed.values] == [0x8000 + 4 * 12 * 4, 0x9000 + 4 * 4, 0x9000]
    assert Param.from_json(params[0].as_json()) == params[0] and "skip" not in params[2].as_json()


def launch_of(grid: tuple[GridDim, GridDim, GridDim], params: tuple[Param, ...] = (), **fields) -> Launch:
    record = dict(function="k", module="k.py", params=params, constexprs={}, grid=grid, num_warps=4, num_stages=2,
                  backend="triton", deferred=False, key="k", cubin="k.cubin", sha256="", symbol="k", shared=0,
                  threads=128, pdl=False)
    return Launch(**record | fields)


def test_grid_rule_and_views():
    launch = launch_of((GridDim(("batch",)), GridDim((8,)), GridDim(("max_query_len",), 4)), shared=512)
    assert shape_of(launch, {"batch": 3, "max_query_len": 9}).grid == (3, 8, 3)
    assert shape_of(launch, {"batch": 3, "max_query_len": 0}).grid == (3, 8, 1)
    assert (shape_of(launch, {"batch": 1, "max_query_len": 1}).threads, launch.shared) == (128, 512)
    merged = DeviceTensor.contiguous(0x1000, (7, 6144), BF16)
    k = merged.columns(4096, 1024)
    assert (k.ptr, k.shape, k.row_stride) == (0x1000 + 4096 * 2, (7, 1024), 6144)
    assert k.reshape((7, 8, 128)).row_stride == 6144


def test_decode_buckets_and_padding_never_touch_real_kv():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_for(9, decode_buckets(64)) == 16 and bucket_for(17, decode_buckets(64)) == 24
    allocator = BlockAllocator(num_blocks=10, block_size=4, reserved=PADDING_BLOCK + 1)
    seqs = [Sequence(i, list(range(6))) for i in range(3)]
    for seq in seqs:
        seq.num_cached = 5
    step = pad_decode_step(pack_step([Chunk(s, 1) for s in seqs], allocator), 8)
    assert len(step["query_lens"]) == 8 and step["input_ids"].shape == (8,)
    assert (step["slot_mapping"][3:] == -1).all(), "padding slots are never written"
    assert (step["block_tables"][3:] == PADDING_BLOCK).all() and (step["context_lens"][3:] == 1).all()
    assert step["logits_indices"].tolist() == list(range(8))
    real_blocks = {b for s in seqs for b in s.table.blocks}
    assert PADDING_BLOCK not in real_blocks, "the padding block is reserved"
    assert allocator.num_blocks == 9


def test_serving_imports_no_compiler_and_no_torch():
    code = ("import sys, pegainfer.cli, pegainfer.runtime.offline, pegainfer.runtime.gpu.engine, "
            "pegainfer.runtime.cuda.driver, pegainfer.runtime.gpu.launch, pegainfer.runtime.scheduler, "
            "pegainfer.runtime.engine_loop, pegainfer.server.app, pegainfer.server.cli; "
            "print([m for m in ('torch', 'triton', 'transformers', 'tilelang', 'cutlass', 'cupy') "
            "if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_lazy_weights_read_the_same_tensors_as_the_eager_load(tiny_checkpoint):
    import numpy as np

    from pegainfer.frontends.load import load_model

    eager, lazy = load_model(tiny_checkpoint).weights, load_model(tiny_checkpoint, lazy=True).weights
    assert sorted(lazy) == sorted(eager) and len(lazy) == len(eager)
    for name in eager:
        assert lazy[name].dtype == eager[name].dtype and np.array_equal(lazy[name], eager[name])


def test_file_spans_hold_each_tensors_bytes(tiny_checkpoint):
    """The GPU uploader reads a tensor's bytes straight from its file when no cast is needed: the span must be
    exactly the tensor's data."""
    from pegainfer.frontends.load import load_model

    model = load_model(tiny_checkpoint, lazy=True)
    checked = 0
    for name in model.weights:
        span = model.weights.span(name)
        if span is None:
            continue
        with open(span.file, "rb") as handle:
            handle.seek(span.offset)
            raw = handle.read(span.nbytes)
        array = model.weights[name]
        assert raw == np.ascontiguousarray(array).tobytes(), name
        checked += 1
    assert checked == len(model.weights)


def test_kv_cache_sized_from_gpu_memory_utilization():
    gb = 1 << 30
    # 140 GB device, 120 GB free after weights and activations, 0.9 -> 106 GB for the KV cache
    assert kv_blocks_for_memory(0.9, gb, free=120 * gb, total=140 * gb) == 106
    with pytest.raises(PegainferError, match="leaves no room for the KV cache"):
        kv_blocks_for_memory(0.1, gb, free=120 * gb, total=140 * gb)
    with pytest.raises(PegainferError, match="must be in"):
        kv_blocks_for_memory(1.5, gb, free=120 * gb, total=140 * gb)


def test_a_manifest_from_another_lowering_is_refused_in_one_line(tmp_path):
    """The engine lowers the model again at start; a manifest whose recorded digests differ from that lowering's
    (another pass pipeline, another graph) is refused with a line naming it, before any cubin is loaded."""
    from pegainfer.frontends.load import embedded_configs, load_spec
    from pegainfer.passes.pipeline import lower

    lowered, _ = lower(load_spec(embedded_configs()["qwen3-0.6b"]).graph)
    path = tmp_path / "manifest.json"
    manifest = Manifest("Qwen3ForCausalLM", "m", "config.json", 90, {"triton": "3.6.0"}, 16, pipeline_digest(),
                        graph_digest(lowered), [])
    check_lowering(manifest, path, lowered)
    for stale in (dict(graph_digest="0" * 16), dict(pipeline_digest="0" * 16)):
        with pytest.raises(PegainferError) as refused:
            check_lowering(Manifest(**vars(manifest) | stale), path, lowered)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{path}: compiled from another lowering")
        assert "run `pegainfer compile` again" in message
    dump(Manifest(**vars(manifest) | dict(graph_digest="0" * 16)), path)
    with pytest.raises(PegainferError, match="compiled from another lowering"):  # the executor checks first
        GpuExecutor(None, lowered, path, {}, Limits(16, 4, 8, 0, 16))


def stand_in_manifest(cache: Path, spec) -> tuple[Path, object, list, dict]:
    """The model's Triton plan written as the build writes it, the compiler's cache entries stood in for:
    (manifest, lowered graph, planned kernels, planned launch id -> cubin key)."""
    from pegainfer.backends import build
    from pegainfer.backends.planning import PlanOptions

    lowered, kernels = build.plan_model(spec, PlanOptions())
    compiled = build.Compiled()
    (cache / "sm_90").mkdir()
    for kernel in kernels:
        for variant in kernel.variants:
            for index, planned in enumerate(variant.launches):
                key = f"{kernel.node}-{variant.name}-{index}"
                (cache / "sm_90" / f"{key}.cubin").write_bytes(key.encode())
                compiled.keys[(90, id(planned))] = key
                compiled.entries[(90, key)] = {
                    "key": key, "cubin": f"{key}.cubin", "sha256": sha256_of(key.encode()), "function": key,
                    "shared": 0, "num_warps": planned.num_warps, "threads": 32 * planned.num_warps, "pdl": True,
                    "scratch": dict.fromkeys(("global_scratch_size", "profile_scratch_size"), 0)}
    path = build._write_manifest(spec, 90, cache, kernels, compiled, {"triton": "3.6.0"}, PlanOptions(), lowered)
    return path, lowered, kernels, {id_: key for (_, id_), key in compiled.keys.items()}


def stand_in_executor(tmp_path, monkeypatch, checkpoint, lora=None, spec=None, borrowed=None, kv_of=None) -> tuple:
    """A GpuExecutor over the tiny model's Triton plan (with LoRA tables: `lora`, a LoraConfig; or `spec`'s,
    borrowing `borrowed` params, taking `kv_of`'s KV cache) on a stand-in driver: (executor, lowered graph,
    planned kernels, planned launch id -> key, the memory taken, the launches made: (symbol, argument values,
    pdl), the copies to the device: (address, bytes), the manifest's launches by key)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from pegainfer.frontends.load import load_spec
    from pegainfer.frontends.lora import with_lora
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu import executor as executing

    spec = spec or load_spec(checkpoint / "config.json")
    spec = spec if lora is None else replace(spec, graph=with_lora(spec.graph, lora))
    path, lowered, kernels, keys = stand_in_manifest(tmp_path, spec)
    memory, launched, copies, loaded = [0x10000], [], [], {}

    def alloc(nbytes: int) -> int:
        memory.append(memory[-1] + -(-max(nbytes, 1) // 256) * 256)
        return memory[-2]

    def launch(function, symbol, grid, threads, shared, stream, address, *, pdl, cluster) -> None:
        """Reads the arguments while they live: a pointer's 8 bytes, a size's 4."""
        pointers = (ctypes.c_void_p * len(loaded[symbol].params)).from_address(address)
        values = [(ctypes.c_uint64 if p.kind is ParamKind.TENSOR else ctypes.c_int32).from_address(at).value
                  for p, at in zip(loaded[symbol].params, pointers)]
        launched.append((symbol, values, pdl))
    for name, stand_in in (("alloc", alloc), ("memset", lambda *args: None),
                           ("copy_to_device", lambda dst, src, stream=None: copies.append((dst, bytes(src)))),
                           ("alloc_pinned", lambda n: np.zeros(n, np.uint8)), ("Event", StandInEvent),
                           ("launch", launch)):
        monkeypatch.setattr(driver, name, stand_in)
    monkeypatch.setattr(executing, "load_function", lambda cubin, launch: (None, launch.symbol))
    monkeypatch.setattr(executing, "upload_weights", lambda graph, weights, stream, arena, skip=(): {
        name: arena.take(t.dtype.itemsize * int(np.prod(t.shape))) for name, t in graph.expanded_params().items()
        if name not in skip})
    gpu = GpuExecutor(SimpleNamespace(stream=0), lowered, path, {}, Limits(64, 4, 8, 0, 16), borrowed=borrowed)
    gpu.share_kv(kv_of) if kv_of is not None else gpu.allocate_kv(32)
    loaded |= {launch.key: launch for k in gpu.kernels.values() for v in k.variants for launch in v.launches}
    return gpu, lowered, kernels, keys, memory, launched, copies, loaded


def test_a_step_launches_each_kernels_variant_by_its_manifest_on_a_stand_in_driver(tmp_path, monkeypatch,
                                                                                     tiny_checkpoint):
    """The executor over a manifest built from the tiny model's plan: a prefill and a decode step launch, kernel by
    kernel and layer by layer, the variant the rule picks, with every pointer argument inside the device memory
    taken and every size argument the step's."""
    gpu, lowered, kernels, keys, memory, launched, _, loaded = stand_in_executor(tmp_path, monkeypatch,
                                                                                 tiny_checkpoint)
    layers = {node.attrs["body"]: node.attrs["count"] for g in lowered.all_graphs() for node in g.nodes
              if node.op == REPEAT}
    allocator = BlockAllocator(num_blocks=32, block_size=16, reserved=1)
    seqs = [Sequence(0, list(range(9))), Sequence(1, list(range(3)))]  # two prompts, then the first one's decode
    for chunks in ([Chunk(seqs[0], 9), Chunk(seqs[1], 3)], [Chunk(seqs[0], 1)]):
        sizes = gpu.upload_step(pack_step(chunks, allocator))
        launched.clear()
        gpu.run(sizes)
        commit_step(chunks)
        seqs[0].token_ids.append(7)  # the token the prefill drew, which the decode step brings
        expected = Counter(keys[id(launch)] for kernel in kernels for launch in pick_variant(kernel, sizes).launches
                           for _ in range(layers.get(kernel.graph, 1)))
        assert Counter(symbol for symbol, _, _ in launched) == expected
        for symbol, values, pdl in launched:
            assert pdl == (sizes["tokens"] <= 16), symbol
            for param, value in zip(loaded[symbol].params, values):
                if param.kind is ParamKind.TENSOR:
                    assert memory[0] <= value < memory[-1], (symbol, param.name)
                elif param.kind is ParamKind.DIM:
                    assert value == sizes[param.value], (symbol, param.name)


def test_a_step_without_adapter_rows_skips_the_lora_updates_and_reads_the_base_outputs(tmp_path, monkeypatch,
                                                                                        tiny_checkpoint):
    """A LoRA graph's step whose rows all have slot -1 launches everything but the lora_add kernels, and the kernels
    after them read the same addresses as in a step that runs them (the updates are written in place)."""
    from pegainfer.frontends.lora import LoraConfig
    from pegainfer.runtime.gpu.engine import skipped_kinds

    gpu, _, _, _, _, launched, _, loaded = stand_in_executor(tmp_path, monkeypatch, tiny_checkpoint,
                                                             LoraConfig(2, 8))
    runs = {}
    for slots in ((-1, -1), (-1, 1)):
        allocator = BlockAllocator(num_blocks=32, block_size=16, reserved=1)
        chunks = [Chunk(Sequence(i, list(range(5))), 5) for i in range(2)]
        for chunk, slot in zip(chunks, slots):
            chunk.seq.lora_slot = slot
        step = pack_step(chunks, allocator, lora=True)
        launched.clear()
        gpu.run(gpu.upload_step(step), skip=skipped_kinds(step))
        runs[slots] = list(launched)
    updates = [entry for entry in runs[(-1, 1)] if entry[0].endswith(("-rows-0", "-rows-1"))]  # lora_add's
    assert len(updates) == 2 * 4 * 2  # shrink and expand, four updates a layer, two layers
    assert [entry for entry in runs[(-1, 1)] if entry not in updates] == runs[(-1, -1)]
    assert skipped_kinds(pack_step([Chunk(Sequence(0, [3]), 1)], BlockAllocator(8, 16), lora=True)) == {"lora_add"}
    assert skipped_kinds(pack_step([Chunk(Sequence(0, [3]), 1)], BlockAllocator(8, 16))) == frozenset()


def test_grammar_masks_filled_late_reach_the_device_after_the_layers_and_before_the_tail(tmp_path, monkeypatch,
                                                                                       tiny_checkpoint):
    """`before_tail` runs once every layer's launches are queued and before the sampler tail's; what it uploads
    (upload_inputs) lands at the step inputs' own addresses, queued after the step's first upload."""
    from pegainfer.ir.step import TOKEN_BITMASK, TOKEN_MASK_INDEX
    from pegainfer.runtime.device_sampling import mask_inputs

    gpu, _, _, _, _, launched, copies, _ = stand_in_executor(tmp_path, monkeypatch, tiny_checkpoint)
    allocator = BlockAllocator(num_blocks=32, block_size=16, reserved=1)
    chunks = [Chunk(Sequence(0, list(range(5))), 5), Chunk(Sequence(1, list(range(3))), 3)]
    sizes = gpu.upload_step(pack_step(chunks, allocator))
    words = gpu.limits.mask_words
    masks = {1: np.arange(words, dtype=np.int32) + 7}
    order: list[str] = []
    gpu.run(sizes, before_tail=lambda: (order.append(f"fill after {len(launched)}"),
                                        gpu.upload_inputs(mask_inputs(2, masks))))
    tail = [i for i, (symbol, _, _) in enumerate(launched) if symbol.startswith("lm_head")]
    assert order == [f"fill after {tail[0]}"] and tail == list(range(tail[0], len(launched)))
    (bitmask_at, bitmask), (index_at, index) = copies[-2:]
    assert bitmask_at == gpu.input_region + gpu.inputs[TOKEN_BITMASK][0] and bitmask == masks[1].tobytes()
    assert index_at == gpu.input_region + gpu.inputs[TOKEN_MASK_INDEX][0]
    assert np.frombuffer(index, np.int32).tolist() == [-1, 0]


def test_a_graph_step_with_grammar_masks_replays_its_layers_then_fills_them_then_its_tail(monkeypatch):
    """The bucket's layers and its sampler tail are captured apart, once; each replay runs the layers, then the
    host's fill (while they run), then the tail. A step without masks keeps the one graph."""
    from types import SimpleNamespace

    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu.engine import GpuEngine

    events: list[str] = []

    class Graph:
        made = 0

        def __init__(self, stream) -> None:
            Graph.made += 1
            self.name = f"g{Graph.made}"

        def __enter__(self) -> "Graph":
            events.append(f"capture {self.name}")
            return self

        def __exit__(self, *error) -> None:
            events.append(f"end {self.name}")

        def replay(self) -> None:
            events.append(f"replay {self.name}")

    class Executor:
        def upload_step(self, step) -> dict:
            return {"tokens": len(step["query_lens"])}

        def run(self, sizes, before_tail=None, skip=frozenset()) -> dict:
            events.append("layers")
            if before_tail is not None:
                before_tail()
            events.append("tail")
            return {}
    monkeypatch.setattr(driver, "Graph", Graph)
    engine = GpuEngine.__new__(GpuEngine)
    engine.executor, engine.graphs = Executor(), {}
    engine.ctx = SimpleNamespace(stream=0, synchronize=lambda: None)
    step = {"query_lens": np.ones(4, np.int32)}
    for _ in range(2):
        engine._replay(step, StepPlan(4, True), lambda: events.append("fill"), frozenset())
    engine._replay(step, StepPlan(4), None, frozenset())
    assert events == ["capture g1", "layers", "end g1", "capture g2", "tail", "end g2",
                      "replay g1", "fill", "replay g2", "replay g1", "fill", "replay g2",
                      "capture g3", "layers", "tail", "end g3", "replay g3"]
