"""A split GEMM's deferred sum (runtime/gpu/planes.py), with no GPU: a norm launch that names the planes of its X2
gets them and no sum runs; any other launch touching the output's memory gets the sum run first; a kernel writing
that memory drops it; planes about to be overwritten get their sum first; a step's end runs the sums of what it
returns and forgets the rest."""

from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.planes import DeferredSums, no_planes, overlaps

BF16, F32 = dtype_from_name("bf16"), dtype_from_name("f32")
SUM = {"key": "sum", "deferred": True, "params": [
    {"name": "C", "kind": "tensor", "value": "o_proj"}, {"name": "P", "kind": "tensor", "value": "planes:o_proj"},
    {"name": "M", "kind": "int", "value": "dim:tokens"}]}
NORM = {"key": "norm", "constexprs": {"PLANES": 4}, "params": [
    {"name": "X", "kind": "tensor", "value": "hidden"}, {"name": "X2", "kind": "tensor", "value": "o_proj"},
    {"name": "P", "kind": "tensor", "value": "planes:o_proj"},
    {"name": "PR", "kind": "int", "value": "rows:planes:o_proj"}]}
READ = {"key": "read", "params": [{"name": "A", "kind": "tensor", "value": "x"}]}


def tensors(c_ptr: int = 0x10000, planes_ptr: int = 0x90000, rows: int = 9) -> dict[str, DeviceTensor]:
    return {"o_proj": DeviceTensor.contiguous(c_ptr, (rows, 2560), BF16),
            "planes:o_proj": DeviceTensor.contiguous(planes_ptr, (64, 2560), F32),
            "hidden": DeviceTensor.contiguous(0x40000, (rows, 2560), BF16)}


def deferred(env: dict[str, DeviceTensor]) -> DeferredSums:
    sums = DeferredSums()
    assert sums.defer(SUM, env, {"tokens": 9}, "linear/decode_planes") == []
    return sums


def test_norm_launch_gets_the_planes_and_no_sum_runs():
    producer = tensors()
    sums = deferred(producer)
    consumer = {"hidden": producer["hidden"], "o_proj": producer["o_proj"]}  # the consumer's own env
    bound, first = sums.bind(NORM, consumer)
    assert first == [] and bound["planes:o_proj"] == producer["planes:o_proj"]
    assert len(sums.pending) == 1, "another reader may still need the sum"


def test_norm_launch_reads_x2_as_stored_where_no_gemm_left_planes():
    bound, first = DeferredSums().bind(NORM, {"hidden": tensors()["hidden"], "o_proj": tensors()["o_proj"]})
    assert first == [] and bound["planes:o_proj"].shape == (0, 2560) and bound["planes:o_proj"].ptr == 0
    assert no_planes(tensors()["o_proj"]).shape == (0, 2560)


def test_a_launch_that_adds_fewer_planes_than_left_reads_the_sum():
    sums = deferred(tensors())
    two = dict(NORM, constexprs={"PLANES": 2})  # 64 rows of planes are 4: more than it adds
    bound, first = sums.bind(two, {"hidden": tensors()["hidden"], "o_proj": tensors()["o_proj"]})
    assert [p.launch["key"] for p in first] == ["sum"] and bound["planes:o_proj"].shape[0] == 0
    assert sums.pending == []


def test_any_other_reader_of_the_memory_gets_the_sum_first_once():
    sums = deferred(tensors())
    column_view = tensors()["o_proj"].columns(1024, 512)  # overlaps the pending output
    _, first = sums.bind(READ, {"x": column_view})
    assert [(p.launch["key"], p.origin, p.sizes) for p in first] == [("sum", "linear/decode_planes", {"tokens": 9})]
    assert sums.bind(READ, {"x": column_view})[1] == [], "summed once"


def test_a_reader_of_other_memory_runs_nothing():
    sums = deferred(tensors())
    elsewhere = DeviceTensor.contiguous(0x10000 + 9 * 2560 * 2, (4, 2560), BF16)  # just past the output's rows
    assert not overlaps(elsewhere, tensors()["o_proj"])
    assert sums.bind(READ, {"x": elsewhere})[1] == [] and len(sums.pending) == 1


def test_a_kernel_writing_the_memory_drops_the_sum():
    sums = deferred(tensors())
    sums.written([DeviceTensor.contiguous(0x10000, (16, 2560), BF16)])
    assert sums.pending == []


def test_planes_overwritten_while_pending_get_their_sum_first():
    sums = deferred(tensors())
    again = tensors(c_ptr=0x200000)  # another output, the same planes
    first = sums.defer(SUM, again, {"tokens": 9})
    assert [p.output.ptr for p in first] == [0x10000] and [p.output.ptr for p in sums.pending] == [0x200000]


def test_a_step_end_sums_what_it_returns_and_forgets_the_rest():
    sums = deferred(tensors())
    sums.defer(SUM, tensors(c_ptr=0x200000, planes_ptr=0x300000), {"tokens": 9})
    ran = []
    sums.flush([tensors(c_ptr=0x200000)["o_proj"]], ran.append)
    assert [p.output.ptr for p in ran] == [0x200000] and sums.pending == []
