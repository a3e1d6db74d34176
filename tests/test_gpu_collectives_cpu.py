"""The GPU runtime's side of tensor parallelism, without a GPU: a rank's executor walks its kernel DAG on a
stand-in driver and a fake communicator, issuing each collective in graph order between the launches that write and
read it, with the element counts and dtypes NCCL gets; the logits' all-gather laid out by 2D copies (checked against
NumPy on a byte array standing in for device memory); deferred split-GEMM sums run before NCCL reads them; the
NCCL communicator's calls into nccl4py's bindings (stood in for); and the engine's step hook and `execute`, which
make a worker rank repeat the driver's step."""

import ctypes
import os
import pickle
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from pegainfer.backends.spec import ParamKind
from pegainfer.errors import PegainferError
from pegainfer.ir import BF16
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import REPEAT
from pegainfer.passes.kernels import is_collective
from pegainfer.passes.shard import Parallelism
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.gpu import nccl as nccl_module
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.collectives import relayout
from pegainfer.runtime.gpu.executor import GpuExecutor, Limits
from pegainfer.runtime.gpu.planes import DeferredSums, Pending
from pegainfer.runtime.kv_blocks import BlockAllocator
from test_gpu_runtime_cpu import StandInEvent, launch_of, stand_in_manifest


class FakeCommunicator:
    """Records each call as ('nccl', op, src, dst, count, dtype name) in the shared event list."""

    def __init__(self, world: int, rank: int, events: list) -> None:
        self.world, self.rank, self.events = world, rank, events

    def __getattr__(self, op: str):
        if op not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            raise AttributeError(op)
        return lambda src, dst, count, dtype, stream: self.events.append(("nccl", op, src, dst, count, dtype.name))


def rank_executor(tmp_path, monkeypatch, checkpoint, world: int = 2, rank: int = 1):
    """A GpuExecutor over rank `rank`'s Triton plan on a stand-in driver and a FakeCommunicator: (executor, lowered
    graph, events: ('launch', symbol, {param: value}) and the communicator's, in order, the 2D copies made)."""
    from pegainfer.frontends.load import load_spec
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu import collectives, executor as executing

    spec = load_spec(checkpoint / "config.json", device="cuda", parallel=Parallelism(world, rank))  # bf16
    path, lowered, _, _ = stand_in_manifest(tmp_path, spec)
    memory, events, copies, loaded = [0x10000], [], [], {}

    def alloc(nbytes: int) -> int:
        memory.append(memory[-1] + -(-max(nbytes, 1) // 256) * 256)
        return memory[-2]

    def launch(function, symbol, grid, threads, shared, stream, address, *, pdl, cluster) -> None:
        params = loaded[symbol].params
        pointers = (ctypes.c_void_p * len(params)).from_address(address)
        values = {p.name: (ctypes.c_uint64 if p.kind is ParamKind.TENSOR else ctypes.c_int32).from_address(at).value
                  for p, at in zip(params, pointers)}
        events.append(("launch", symbol, values))
    for name, stand_in in (("alloc", alloc), ("memset", lambda *args: None),
                           ("copy_to_device", lambda dst, src, stream=None: None),
                           ("alloc_pinned", lambda n: np.zeros(n, np.uint8)), ("Event", StandInEvent),
                           ("launch", launch)):
        monkeypatch.setattr(driver, name, stand_in)
    monkeypatch.setattr(executing, "load_function", lambda cubin, launch: (None, launch.symbol))
    monkeypatch.setattr(executing, "upload_weights", lambda graph, weights, stream, arena, skip=(): {
        name: arena.take(t.dtype.itemsize * int(np.prod(t.shape))) for name, t in graph.expanded_params().items()})
    monkeypatch.setattr(collectives, "copy_2d", lambda copy, stream: copies.append(copy))
    gpu = GpuExecutor(SimpleNamespace(stream=0), lowered, path, {}, Limits(64, 4, 8, 0, 16),
                      FakeCommunicator(world, rank, events))
    gpu.collectives.copy = lambda copy, stream: copies.append(copy)
    gpu.allocate_kv(32)
    loaded |= {launch.key: launch for k in gpu.kernels.values() for v in k.variants for launch in v.launches}
    return gpu, lowered, events, copies


def expected_collectives(lowered) -> list[tuple[str, str]]:
    """(op, node) of every collective a step issues, in graph order, bodies once per layer."""
    order = []
    for node in lowered.nodes:
        if node.op == REPEAT:
            body = lowered.subgraphs[node.attrs["body"]]
            order += [(n.op, n.name) for _ in range(node.attrs["count"]) for n in body.nodes if is_collective(n)]
        elif is_collective(node):
            order.append((node.op, node.name))
    return order


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_step_issues_its_collectives_in_graph_order_between_the_launches_around_them(
        tmp_path, monkeypatch, tiny_checkpoint, world):
    """A prefill step and a decode step of rank 1: every collective of the graph, in order; each all-reduce sums
    the buffer the launch before it wrote (tokens x hidden bf16 elements) into the one the next launch reads; the
    all-gather sends the LM head's part of the vocabulary (rows x part) and lays it out with one 2D copy per rank
    into the rows the sampler tail reads."""
    gpu, lowered, events, copies = rank_executor(tmp_path, monkeypatch, tiny_checkpoint, world)
    hidden = lowered.value_types()["embed"].shape[-1]
    vocab = lowered.value_types()["logits"].shape[-1]
    allocator = BlockAllocator(num_blocks=32, block_size=16, reserved=1)
    seqs = [Sequence(0, list(range(9))), Sequence(1, list(range(3)))]
    for chunks in ([Chunk(seqs[0], 9), Chunk(seqs[1], 3)], [Chunk(seqs[0], 1), Chunk(seqs[1], 1)]):
        step = pack_step(chunks, allocator)
        sizes = gpu.upload_step(step)
        events.clear(), copies.clear()
        gpu.run(sizes)
        commit_step(chunks)
        for seq in seqs:
            seq.token_ids.append(7)
        issued = [e for e in events if e[0] == "nccl"]
        assert [(op, node) for (_, op, *_), (_, node) in zip(issued, expected_collectives(lowered))] == \
            expected_collectives(lowered) and len(issued) == len(expected_collectives(lowered))
        tokens, rows = sizes["tokens"], sizes["samples"]
        for index, event in enumerate(events):
            if event[0] != "nccl":
                continue
            _, op, src, dst, count, dtype = event
            wrote = events[index - 1]
            assert wrote[0] == "launch" and src in wrote[2].values(), (op, wrote[1])  # the launch before wrote it
            assert dtype == "bf16" and src != dst
            if op == "all_reduce":
                assert count == tokens * hidden
                read = events[index + 1]
                assert read[0] == "launch" and dst in read[2].values()  # the next launch reads the sum
            else:
                part = -(-vocab // world)
                assert op == "all_gather" and count == rows * part and events[index + 1][1].startswith("sampler-")
                assert [c.rows for c in copies] == [rows] * world and len({c.src for c in copies}) == world
                assert all(c.width == part * 2 and c.src_pitch == part * 2 and c.dst_pitch == part * world * 2
                           for c in copies)
                assert [c.dst - copies[0].dst for c in copies] == [r * part * 2 for r in range(world)]
                tail = events[index + 1][2]
                assert copies[0].dst == tail["logits_ptr"]


@pytest.mark.parametrize("rows, part, world, width", [(3, 5, 2, 10), (1, 7, 4, 28), (4, 6, 4, 21)])
def test_the_gathered_parts_are_laid_out_as_numpy_concatenates_them(rows, part, world, width):
    """[world, rows, part] landed by NCCL, copied into [rows, world * part] rows; the logits may be a narrower view
    of those rows (`width` columns: the split that cuts the padding of a vocabulary the ranks do not divide)."""
    stride = world * part
    rng = np.random.default_rng(0)
    parts = rng.standard_normal((world, rows, part)).astype(np.float32)
    memory = np.zeros(1 << 16, np.uint8)
    landing_at, out_at = 256, 256 + parts.nbytes + 256
    memory[landing_at: landing_at + parts.nbytes] = parts.view(np.uint8).reshape(-1)
    f32 = dtype_from_name("f32")
    landing = DeviceTensor.contiguous(landing_at, (world, rows, part), f32)
    out = DeviceTensor(out_at, (rows, width), f32, stride)
    for copy in relayout(landing, out, world):
        for row in range(copy.rows):
            src, dst = copy.src + row * copy.src_pitch, copy.dst + row * copy.dst_pitch
            memory[dst: dst + copy.width] = memory[src: src + copy.width]
    laid = memory[out_at: out_at + rows * stride * 4].view(np.float32).reshape(rows, stride)
    assert np.array_equal(laid, np.concatenate(list(parts), axis=-1))


def test_a_rank_graph_without_a_communicator_or_with_another_world_is_refused_in_one_line(
        tmp_path, monkeypatch, tiny_checkpoint):
    from pegainfer.frontends.load import load_spec

    path, lowered, _, _ = stand_in_manifest(tmp_path, load_spec(tiny_checkpoint / "config.json",
                                                                parallel=Parallelism(2, 0)))
    for communicator, words in ((None, "needs a communicator"),
                                (FakeCommunicator(4, 0, []), "rank 0's graph of 2 ranks; the communicator is rank 0 of 4"),
                                (FakeCommunicator(2, 1, []), "rank 0's graph of 2 ranks; the communicator is rank 1 of 2")):
        with pytest.raises(PegainferError, match=words) as refused:
            GpuExecutor(SimpleNamespace(stream=0), lowered, path, {}, Limits(16, 4, 8, 0, 16), communicator)
        assert "\n" not in str(refused.value)


def test_a_deferred_sum_of_a_collectives_input_runs_before_nccl_reads_it():
    """A split GEMM's output left as planes (its sum deferred) is summed before the all-reduce that reads it; a
    pending sum of other memory stays deferred."""
    sums = DeferredSums()
    partial = DeviceTensor.contiguous(0x1000, (4, 64), BF16)
    other = DeviceTensor.contiguous(0x8000, (4, 64), BF16)
    for output, planes in ((partial, 0x20000), (other, 0x30000)):
        sums.pending.append(Pending(output, DeviceTensor.contiguous(planes, (16, 64), BF16),
                                    launch_of((), symbol=f"sum_{output.ptr:x}"), {}, {}))
    runs = sums.before_reading([partial])
    assert [launch.symbol for _, launch, _, _ in runs] == ["sum_1000"]
    assert [p.output for p in sums.pending] == [other] and sums.before_reading([partial]) == []


class StandInNccl:
    """nccl4py's bindings as far as NcclCommunicator uses them, recording each call."""
    DataType = SimpleNamespace(Bfloat16=9, Float16=6, Float32=7, Int32=2, Int64=4, Float8e4m3=10, Float8e5m2=11)
    RedOp = SimpleNamespace(Sum=0)
    NCCLError = type("NCCLError", (Exception,), {})

    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append((name, args))
            if name == "get_unique_id":
                return bytes(range(128))
            if name == "comm_init_rank":
                return "comm"
            if name == "allto_all":
                raise self.NCCLError("unhandled cuda error")
        return call


def test_the_nccl_communicator_calls_nccl4py_with_counts_dtypes_the_stream_and_nvls_off(monkeypatch):
    """The unique id travels as bytes (a Rendezvous pickles); each rank joins with (world, id, rank); a collective
    is NCCL's call with the element count, NCCL's dtype, a sum, the communicator and the stream; NVLS is off unless
    the environment says otherwise, which is kept; an NCCL error is one line naming the call."""
    fake = StandInNccl()
    monkeypatch.setitem(sys.modules, "nccl", SimpleNamespace())
    monkeypatch.setitem(sys.modules, "nccl.bindings", SimpleNamespace(nccl=fake))
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")
    rendezvous = pickle.loads(pickle.dumps(nccl_module.Rendezvous(nccl_module.make_unique_id(), 2, 1)))
    comm = nccl_module.NcclCommunicator(rendezvous)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NCCL_RUNTIME_CONNECT"] == "1"
    comm.all_reduce(0x1000, 0x2000, 640, BF16, stream=77)
    comm.all_gather(0x3000, 0x4000, 96, dtype_from_name("f32"), stream=77)
    name, (world, unique_id, rank) = fake.calls[1]
    assert (name, world, bytes(unique_id), rank) == ("comm_init_rank", 2, bytes(range(128)), 1)
    assert fake.calls[2:] == [("all_reduce", (0x1000, 0x2000, 640, 9, 0, "comm", 77)),
                              ("all_gather", (0x3000, 0x4000, 96, 7, "comm", 77))]
    with pytest.raises(PegainferError, match="^NCCL ncclAlltoAll failed: unhandled cuda error$"):
        comm.all_to_all(0, 0, 1, BF16, stream=77)
    comm.close()
    assert fake.calls[-1] == ("comm_destroy", ("comm",)) and comm.handle is None
    with pytest.raises(PegainferError, match="rank 2 of 2"):
        nccl_module.Rendezvous(rendezvous.unique_id, 2, 2)


class RecordingExecutor:
    """The executor as the engine drives it: what it uploads and launches, in the shared event list."""

    def __init__(self, events: list) -> None:
        self.events, self.limits = events, SimpleNamespace(num_blocks=32)

    def upload_step(self, step) -> dict:
        self.events.append(("upload", {name: np.asarray(a).tolist() for name, a in step.items()}))
        return {"tokens": len(step["input_ids"])}

    def upload_inputs(self, arrays) -> None:
        self.events.append("masks")

    def run(self, sizes, before_tail=None, skip=frozenset()) -> dict:
        self.events.append(("layers", sizes["tokens"]))
        if before_tail is not None:
            before_tail()
        self.events.append("tail")
        return {}


class StandInGraph:
    """A CUDA graph recording its capture and replays where its stream's engine records (the stream is that list)."""

    def __init__(self, events: list) -> None:
        self.events, self.name = events, f"graph{sum(isinstance(e, tuple) and e[0] == 'capture' for e in events)}"

    def __enter__(self):
        self.events.append(("capture", self.name))
        return self

    def __exit__(self, *error) -> None:
        self.events.append(("end", self.name))

    def replay(self) -> None:
        self.events.append(("replay", self.name))


def stand_in_engine(monkeypatch, events: list, on_step=None):
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu.engine import EngineOptions, GpuEngine, decode_buckets

    monkeypatch.setattr(driver, "Graph", StandInGraph)
    engine = GpuEngine.__new__(GpuEngine)
    engine.executor, engine.graphs, engine.on_step = RecordingExecutor(events), {}, on_step
    engine.ctx = SimpleNamespace(stream=events, synchronize=lambda: None)
    engine.options, engine.buckets = EngineOptions(max_batch=8), decode_buckets(8)
    engine.allocator = BlockAllocator(num_blocks=32, block_size=16, reserved=1)
    engine._slots, engine.no_masks = (0, 0), np.zeros((1, 1), np.int32)
    engine.model = SimpleNamespace(spec=SimpleNamespace(graph=SimpleNamespace(inputs={})))  # no LoRA tables
    return engine


def test_a_worker_rank_executes_the_step_the_driver_hooks_with_the_same_launches(monkeypatch):
    """The driver's hook hears each step's packed (decode: padded) inputs and plan before anything is uploaded; a
    worker's `execute` of them uploads the same inputs and makes the same launches: the eager prefill, the decode
    bucket's graph captured then replayed, a constrained step's layers and tail captured apart."""
    from pegainfer.runtime.gpu.engine import StepPlan

    driver_events, worker_events, heard = [], [], []
    leader = stand_in_engine(monkeypatch, driver_events,
                             on_step=lambda step, plan: (heard.append((step, plan)), driver_events.append("hook")))
    worker = stand_in_engine(monkeypatch, worker_events)
    seqs = [Sequence(i, list(range(5))) for i in range(3)]
    steps = ([Chunk(s, 5) for s in seqs], [Chunk(s, 1) for s in seqs], [Chunk(s, 1) for s in seqs],
             [Chunk(s, 1) for s in seqs])
    for index, chunks in enumerate(steps):
        driver_events.clear(), worker_events.clear()
        fill = (lambda rows: {}) if index == 3 else None
        leader.run(chunks, fill_late=fill)
        for seq in seqs:
            seq.token_ids.append(1)
        step, plan = heard[-1]
        assert driver_events[0] == "hook" and plan == pickle.loads(pickle.dumps(plan))
        assert plan == StepPlan(None if index == 0 else 4, index == 3)
        worker.execute(step, plan)
        assert [e for e in driver_events if e not in ("hook", "masks")] == worker_events
    assert worker_events[:3] == [worker_events[0], ("capture", "graph0"), ("layers", 4)]  # bucket 4's split graph
    assert sorted(worker.graphs) == sorted(leader.graphs) == [(4, 1, False, frozenset()), (4, 1, True, frozenset())]


def test_the_kv_pool_a_rank_hands_out_is_limited_to_the_blocks_every_rank_holds(monkeypatch):
    engine = stand_in_engine(monkeypatch, [])
    assert engine.kv_blocks == 32
    engine.limit_kv_blocks(20)
    assert engine.allocator.num_blocks == 19  # the padding block is reserved
    for bad in (1, 33):
        with pytest.raises(PegainferError, match=r"expected 2 \.\. 32 blocks"):
            engine.limit_kv_blocks(bad)
