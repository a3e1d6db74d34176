"""Launching TileLang's and CuTe DSL's cubins, the parts that need no GPU: TMA descriptors resolved for a step
and checked as the driver would, arguments packed by the manifest ABI (a 128-byte descriptor by value, 64-byte
aligned; pointers; sizes and strides), and the launch shape from the recorded block."""

import ctypes
from dataclasses import replace

import pytest

from pegainfer.backends.manifest import Launch
from pegainfer.backends.spec import GridDim, Param, ParamKind, TmaDescriptor
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.launch import pack_launch, shape_of
from pegainfer.runtime.gpu.tma import TENSOR_MAP_BYTES, TiledDescriptor, resolve

BF16 = dtype_from_name("bf16")
DESCRIPTOR = TmaDescriptor(dtype=9, dims=(2560, "tokens"), strides=(2, 5120), box=(64, 128), element_strides=(1, 1),
                           interleave=0, swizzle=3, l2_promotion=2, oob_fill=0)
TMA = Param("A_desc", ParamKind.TMA, "x", "tma", tma=DESCRIPTOR)


def launch(grid: tuple[GridDim, ...], threads: int, shared: int, params: tuple[Param, ...] = (), **more) -> Launch:
    """A manifest launch record with the fields the launcher reads; the rest filler."""
    return Launch("decode_tile", "decode_tile.py", params, {}, grid, threads // 32, 1, "tilelang", False, "key",
                  "key.cubin", "0" * 64, "decode_gemm_kernel", shared, threads, True, **more)


def test_tma_descriptor_resolves_step_sizes_and_checks_alignment():
    resolved = resolve(DESCRIPTOR, 0x1000, {"tokens": 300})
    assert resolved.dims == (2560, 300) and resolved.strides == (5120,) and resolved.box == (64, 128)
    with pytest.raises(PegainferError, match="not 16-byte aligned"):
        resolve(DESCRIPTOR, 0x1008, {"tokens": 300})
    with pytest.raises(PegainferError, match="multiples of 16 bytes"):
        resolve(replace(DESCRIPTOR, strides=(2, 5122)), 0x1000, {"tokens": 300})
    with pytest.raises(PegainferError, match="not a size of this step"):
        resolve(DESCRIPTOR, 0x1000, {"batch": 3})


def test_pack_launch_lays_out_tma_pointer_and_int_arguments():
    seen: list[TiledDescriptor] = []

    def encode(d: TiledDescriptor) -> bytes:
        seen.append(d)
        return bytes(range(TENSOR_MAP_BYTES))
    params = [TMA, Param("R", ParamKind.TENSOR, "r", "*bf16"), Param("M", ParamKind.DIM, "tokens", "i32"),
              Param("MAXB", ParamKind.STRIDE, "tables", "i32"), Param("PR", ParamKind.PLANE_ROWS, "r", "i32")]
    tensors = {"x": DeviceTensor.contiguous(0x10000, (300, 2560), BF16),
               "r": DeviceTensor.contiguous(0x20000, (300, 2560), BF16),
               "tables": DeviceTensor(0x30000, (2, 7), dtype_from_name("i32"), 64),
               "planes:r": DeviceTensor.contiguous(0x50000, (48, 2560), dtype_from_name("f32"))}
    args = pack_launch(params, tensors, {"tokens": 300}, encode=encode)
    pointers = [args.pointers[i] for i in range(5)]
    assert pointers[0] % 64 == 0 and ctypes.string_at(pointers[0], TENSOR_MAP_BYTES) == bytes(range(128))
    assert seen[0].address == 0x10000 and seen[0].dims == (2560, 300)
    assert ctypes.c_uint64.from_address(pointers[1]).value == 0x20000
    assert ctypes.c_int32.from_address(pointers[2]).value == 300
    assert ctypes.c_int32.from_address(pointers[3]).value == 64
    assert ctypes.c_int32.from_address(pointers[4]).value == 48  # the planes' rows, their leading dim


def test_pack_launch_encodes_each_descriptor_once():
    """A step's weights keep their descriptors from step to step; a new step size or address is a new one."""
    calls: list[TiledDescriptor] = []

    def encode(d: TiledDescriptor) -> bytes:
        calls.append(d)
        return d.dims[1].to_bytes(2, "little") * 64
    params = [TMA]
    for tokens, address in ((300, 0x10000), (300, 0x10000), (512, 0x10000), (300, 0x40000), (512, 0x10000)):
        tensors = {"x": DeviceTensor.contiguous(address, (tokens, 2560), BF16)}
        args = pack_launch(params, tensors, {"tokens": tokens}, encode=encode)
        assert ctypes.string_at(args.pointers[0], 2) == tokens.to_bytes(2, "little")
    assert [(d.dims[1], d.address) for d in calls] == [(300, 0x10000), (512, 0x10000), (300, 0x40000)]


def test_launch_shape_uses_the_recorded_block():
    record = launch((GridDim((2560,), 128), GridDim(("tokens",), 128), GridDim((1,), 1)), 384, 98304)
    shape = shape_of(record, {"tokens": 1000})
    assert shape.grid == (20, 8, 1) and shape.threads == 384 and shape.shared == 98304


def test_a_cluster_recorded_in_the_manifest_reaches_the_launch_as_its_attribute(monkeypatch):
    """A launch whose kernel meets the other CTAs of its cluster (TileLang leaves the cluster to the launch) goes
    with the manifest's cluster shape, as a cluster-dimension attribute beside the programmatic one; a launch
    without a recorded cluster asks for none."""
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu import launch as launching

    seen = []
    monkeypatch.setattr(driver, "launch", lambda *args, **kwargs: seen.append(kwargs))
    record = launch((GridDim((2560,), 16), GridDim(("tokens",), 8), GridDim((2,), 1)), 160, 73728,
                    (Param("M", ParamKind.DIM, "tokens", "i32"),))
    for cluster in ((1, 1, 2), None):
        launching.launch_kernel(None, replace(record, cluster=cluster) if cluster else record, {}, {"tokens": 4}, 0,
                                pdl=True)
    assert seen == [{"pdl": True, "cluster": (1, 1, 2)}, {"pdl": True, "cluster": (1, 1, 1)}]
    config = driver._launch_config((160, 1, 2), 160, 73728, 0, True, (1, 1, 2))
    kinds = driver._driver().CUlaunchAttributeID
    assert [a.id for a in config.attrs] == [kinds.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                                            kinds.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION] and config.numAttrs == 2
    dim = config.attrs[1].value.clusterDim
    assert (dim.x, dim.y, dim.z) == (1, 1, 2) and (config.gridDimX, config.gridDimZ) == (160, 2)
    plain = driver._launch_config((160, 1, 2), 160, 0, 0, False, (1, 1, 2))  # held: attrs view its memory
    assert [a.id for a in plain.attrs] == [kinds.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION]


def test_a_plain_launch_keeps_the_gil_and_names_the_kernel_when_it_fails(monkeypatch):
    """Plain launches go to libcuda's cuLaunchKernel through ctypes.PyDLL (held: cuda.bindings would give the GIL
    up, and a busy event loop would keep it for a switch interval) with the handles as integers; a failing status
    raises the driver's error name with the kernel and its grid."""
    import pytest

    from pegainfer.runtime.cuda import driver

    calls = []

    def stand_in(name):
        def call(*args):
            calls.append((name, args))
            return 1 if args[1] == 99 else 0  # CUDA_ERROR_INVALID_VALUE for a grid of 99
        return call
    monkeypatch.setattr(driver, "_held", stand_in)
    function, stream = driver._driver().CUfunction(), driver._driver().CUstream()
    driver.launch(function, "gemm", (4, 2, 1), 128, 1024, stream, 0x1234)
    assert calls == [("cuLaunchKernel", (0, 4, 2, 1, 128, 1, 1, 1024, 0, 0x1234, None))]
    with pytest.raises(driver.CudaError, match=r"cuLaunchKernel\(gemm, grid=\(99, 1, 1\).*CUDA_ERROR_INVALID_VALUE"):
        driver.launch(function, "gemm", (99, 1, 1), 128, 0, stream, 0x1234)
