"""What the GPU runtime does that needs no GPU: argument packing by the manifest ABI, grid rules, device views,
decode buckets and padding, the reserved padding block, and the rule that serving imports no compiler."""

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from pegainfer.errors import PegainferError
from pegainfer.ir import BF16, INT32
from pegainfer.runtime.batch import Chunk, Sequence, pack_step
from pegainfer.runtime.gpu.abi import DeviceTensor, grid_of
from pegainfer.runtime.gpu.engine import PADDING_BLOCK, bucket_for, decode_buckets, pad_decode_step
from pegainfer.runtime.gpu.launch import pack_launch
from pegainfer.runtime.gpu.memory import kv_blocks_for_memory
from pegainfer.runtime.kv_blocks import BlockAllocator


def test_arguments_are_packed_in_abi_order_with_the_right_types():
    tensors = {"x": DeviceTensor(0x7000, (5, 64), BF16, 192), "rows": DeviceTensor(0x9000, (3,), INT32, 1)}
    params = [{"name": "x_ptr", "kind": "tensor", "value": "x"},
              {"name": "rows_ptr", "kind": "tensor", "value": "rows"},
              {"name": "M", "kind": "int", "value": "dim:tokens"},
              {"name": "stride_x", "kind": "int", "value": "stride:x"},
              {"name": "global_scratch", "kind": "scratch", "value": "0"},
              {"name": "profile_scratch", "kind": "scratch", "value": "0"}]
    packed = pack_launch(params, tensors, {"tokens": 5})
    assert [type(v) for v in packed.values] == [ctypes.c_uint64] * 2 + [ctypes.c_int32] * 2 + [ctypes.c_uint64] * 2
    assert [v.value for v in packed.values] == [0x7000, 0x9000, 5, 192, 0, 0]
    pointers = (ctypes.c_void_p * 6).from_address(packed.address)
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0x7000
    assert ctypes.c_int32.from_address(pointers[3]).value == 192


def test_grid_rule_and_views():
    launch = {"grid": [{"factors": ["batch"], "block": 1}, {"factors": [8], "block": 1},
                       {"factors": ["max_query_len"], "block": 4}]}
    assert grid_of(launch, {"batch": 3, "max_query_len": 9}) == (3, 8, 3)
    assert grid_of(launch, {"batch": 3, "max_query_len": 0}) == (3, 8, 1)
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
