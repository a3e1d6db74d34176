"""A split GEMM's deferred sum (runtime/gpu/planes.py), with no GPU: a norm launch that names the planes of its X2
gets them and no sum runs; any other launch touching the output's memory gets the sum run first; a kernel writing
that memory drops it; a GEMM about to overwrite planes still pending gets their sum run before it; a step's end runs
the sums of what it returns and forgets the rest. Last, the executor's order over layers of o_proj, its norm
launch, down and the next layer's, then the logits kernel."""

import pytest

from pegainfer.backends.manifest import Launch
from pegainfer.backends.spec import GridDim, Param, ParamKind
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.planes import DeferredSums, no_planes, overlaps

BF16, F32 = dtype_from_name("bf16"), dtype_from_name("f32")


def tensor(name: str, value: str) -> Param:
    return Param(name, ParamKind.TENSOR, value, "*bf16")


def planes(value: str) -> Param:
    return Param("P", ParamKind.PLANES, value, "*fp32")


def launch(key: str, params: list[Param], constexprs: dict | None = None, deferred: bool = False) -> Launch:
    return Launch("k", "k.py", tuple(params), constexprs or {}, (GridDim(),) * 3, 4, 1, "tilelang", deferred, key,
                  f"{key}.cubin", "", key, 0, 128, True)


def gemm(out: str) -> Launch:
    return launch(f"gemm {out}", [tensor("A", "a"), planes(out)], {"PARTIAL": True, "SPLIT": 4})


def total(out: str) -> Launch:
    return launch(f"sum {out}", [tensor("C", out), planes(out)], {"SPLIT": 4}, deferred=True)


def norm(x2: str, added: int = 4) -> Launch:
    return launch(f"norm {x2}", [tensor("X", "hidden"), tensor("X2", x2), planes(x2),
                                 Param("PR", ParamKind.PLANE_ROWS, x2, "i32")], {"PLANES": added})


READ = launch("read", [tensor("A", "x")])


def rows(ptr: int, n: int = 9, dtype=BF16, width: int = 2560) -> DeviceTensor:
    return DeviceTensor.contiguous(ptr, (n, width), dtype)


def produced(sums: DeferredSums, c_ptr: int = 0x10000, planes_ptr: int = 0x90000) -> dict[str, DeviceTensor]:
    """o_proj's variant scheduled: its GEMM runs, its sum is deferred."""
    env = {"a": rows(0x70000), "o_proj": rows(c_ptr), "planes:o_proj": rows(planes_ptr, 64, F32)}
    runs = sums.schedule([gemm("o_proj"), total("o_proj")], env, {"tokens": 9}, "linear/decode_planes_16x32")
    assert [launch.key for _, launch, _, _ in runs] == ["gemm o_proj"] and sums.pending[-1].output.ptr == c_ptr
    return env


def consumer(env: dict[str, DeviceTensor]) -> dict[str, DeviceTensor]:
    return {"hidden": rows(0x40000), "o_proj": env["o_proj"]}  # the consumer's own env: no planes in it


def test_norm_launch_gets_the_planes_and_no_sum_runs():
    sums = DeferredSums()
    env = produced(sums)
    ((_, launch, bound, _),) = sums.schedule([norm("o_proj")], consumer(env), {"tokens": 9})
    assert launch.key == "norm o_proj" and bound["planes:o_proj"] == env["planes:o_proj"]
    assert len(sums.pending) == 1, "another reader may still need the sum"


def test_norm_launch_reads_x2_as_stored_where_no_gemm_left_planes():
    ((_, _, bound, _),) = DeferredSums().schedule([norm("o_proj")], {"hidden": rows(0x40000), "o_proj": rows(0)}, {})
    assert bound["planes:o_proj"].shape == (0, 2560) and bound["planes:o_proj"].ptr == 0
    assert no_planes(rows(0)).shape == (0, 2560)


def test_a_launch_that_adds_fewer_planes_than_left_reads_the_sum():
    sums = DeferredSums()
    env = produced(sums)
    two = norm("o_proj", added=2)  # 64 rows of planes are 4: more than it adds
    runs = sums.schedule([two], consumer(env), {})
    assert [launch.key for _, launch, _, _ in runs] == ["sum o_proj", "norm o_proj"]
    assert runs[1][2]["planes:o_proj"].shape[0] == 0 and sums.pending == []


def swapped_split(sums: DeferredSums, split: int) -> dict[str, DeviceTensor]:
    """o_proj on a swapped tile (planes of 256 rows) split `split` ways, its planes scratch sized for 4."""
    stride = {"PLANE_STRIDE": 256, "SPLIT": split}
    env = {"a": rows(0x700000, 64), "o_proj": rows(0x100000, 64), "planes:o_proj": rows(0x900000, 4 * 256, F32)}
    sums.schedule([launch("gemm o_proj", [tensor("A", "a"), planes("o_proj")], {"PARTIAL": True} | stride),
                   launch("sum o_proj", [tensor("C", "o_proj"), planes("o_proj")], stride, deferred=True)],
                  env, {"tokens": 64})
    return env


def wide_norm(x2: str, stride: int) -> Launch:
    return launch(f"norm {x2}", [tensor("X", "hidden"), tensor("X2", x2), planes(x2),
                                 Param("PR", ParamKind.PLANE_ROWS, x2, "i32")], {"PLANES": 4, "PLANE_STRIDE": stride})


def test_a_norm_launch_adds_only_the_planes_a_swapped_tile_wrote():
    sums = DeferredSums()
    env = swapped_split(sums, 2)
    ((_, launch_, bound, _),) = sums.schedule([wide_norm("o_proj", 256)], consumer(env), {"tokens": 64})
    assert launch_.key == "norm o_proj" and bound["planes:o_proj"].ptr == 0x900000
    assert bound["planes:o_proj"].shape == (2 * 256, 2560), "two planes of 256 rows, not the scratch's four"


def test_a_norm_launch_adding_planes_of_another_stride_reads_the_sum():
    sums = DeferredSums()
    env = swapped_split(sums, 4)
    runs = sums.schedule([wide_norm("o_proj", 16)], consumer(env), {"tokens": 64})
    assert [launch.key for _, launch, _, _ in runs] == ["sum o_proj", "norm o_proj"]
    assert runs[1][2]["planes:o_proj"].shape[0] == 0 and sums.pending == []


def test_any_other_reader_of_the_memory_gets_the_sum_first_once():
    sums = DeferredSums()
    env = produced(sums)
    column_view = env["o_proj"].columns(1024, 512)  # overlaps the pending output
    runs = sums.schedule([READ], {"x": column_view}, {"tokens": 9})
    assert [(origin, launch.key) for origin, launch, _, _ in runs] == [("linear/decode_planes_16x32", "sum o_proj"),
                                                                       ("", "read")]
    assert runs[0][3] == {"tokens": 9} and runs[0][2]["planes:o_proj"] == env["planes:o_proj"]
    assert [launch.key for _, launch, _, _ in sums.schedule([READ], {"x": column_view}, {})] == ["read"]


def test_a_reader_of_other_memory_runs_nothing():
    sums = DeferredSums()
    env = produced(sums)
    past = rows(env["o_proj"].ptr + 9 * 2560 * 2, 4)  # just past the output's rows
    assert not overlaps(past, env["o_proj"]) and overlaps(rows(past.ptr - 2, 1), env["o_proj"])
    assert len(sums.schedule([READ], {"x": past}, {})) == 1 and len(sums.pending) == 1


def test_a_kernel_writing_the_memory_drops_the_sum():
    sums = DeferredSums()
    env = produced(sums)
    sums.written([rows(env["o_proj"].ptr, 16)])
    assert sums.pending == []


def test_a_gemm_overwriting_pending_planes_gets_their_sum_run_before_it():
    sums = DeferredSums()
    produced(sums)
    again = {"a": rows(0x70000), "o_proj": rows(0x200000), "planes:o_proj": rows(0x90000, 64, F32)}
    runs = sums.schedule([gemm("o_proj"), total("o_proj")], again, {})
    assert [(launch.key, env["o_proj"].ptr) for _, launch, env, _ in runs] == [("sum o_proj", 0x10000),
                                                                                  ("gemm o_proj", 0x200000)]
    assert [p.output.ptr for p in sums.pending] == [0x200000]


def test_a_split_gemm_without_its_planes_scratch_is_an_error():
    with pytest.raises(PegainferError, match="no scratch for its planes:o_proj"):
        DeferredSums().schedule([gemm("o_proj")], {"a": rows(0x70000)}, {})


def test_a_step_end_sums_what_it_returns_and_forgets_the_rest():
    sums = DeferredSums()
    produced(sums)
    env = produced(sums, c_ptr=0x200000, planes_ptr=0x300000)
    assert [run[2]["o_proj"].ptr for run in sums.flush([env["o_proj"]])] == [0x200000] and sums.pending == []


def test_layers_in_the_executors_order_sum_once_before_the_logits_with_the_last_layers_planes():
    """Per layer: o_proj (its output buffer the same each layer), the norm launch adding its planes, down (a carry
    buffer, two alternated by layer, as its planes are), then the next layer's norm launch adding down's planes;
    the logits kernel reads the last layer's down. Every kernel's outputs are `written` first, as the executor
    does."""
    sums, runs, layers = DeferredSums(), [], 3
    down_of = [rows(0x400000 + 0x100000 * (layer % 2)) for layer in range(layers)]
    for layer in range(layers):
        if layer:  # the layer's first norm launch adds the previous layer's down
            runs += sums.schedule([norm("delta")], {"hidden": rows(0x40000), "delta": down_of[layer - 1]}, {})
        sums.written([rows(0x10000)])
        o_proj = {"a": rows(0x70000), "o_proj": rows(0x10000), "planes:o_proj": rows(0x900000, 64, F32)}
        runs += sums.schedule([gemm("o_proj"), total("o_proj")], o_proj, {}, f"o_proj {layer}")
        runs += sums.schedule([norm("o_proj")], {"hidden": rows(0x40000), "o_proj": rows(0x10000)}, {})
        sums.written([down_of[layer]])
        planes = rows(0xa00000 + 0x100000 * (layer % 2), 64, F32)
        runs += sums.schedule([gemm("down"), total("down")], {"a": rows(0x70000), "down": down_of[layer],
                                                            "planes:down": planes}, {}, f"down {layer}")
    runs += sums.schedule([READ], {"x": down_of[-1]}, {})  # the logits kernel
    keys = [launch.key for _, launch, _, _ in runs]
    assert keys.count("sum down") == 1 and keys.count("sum o_proj") == 0 and keys[-2:] == ["sum down", "read"]
    assert runs[-2][0] == f"down {layers - 1}" and runs[-2][2]["planes:down"].ptr == 0xa00000 + 0x100000 * (
        (layers - 1) % 2)
    bound = [env[p.buffer] for _, launch, env, _ in runs if launch.key.startswith("norm")
             for p in launch.params if p.kind is ParamKind.PLANES]
    assert len(bound) == 2 * layers - 1 and all(t.shape[0] == 64 for t in bound), "every norm launch got planes"
