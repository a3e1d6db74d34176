"""The GPU weight loader's pipeline on the CPU: reader threads fill a small ring of staging buffers from the
safetensors file spans (and in-memory arrays) and the pieces are sent in order; a host array stands in for device
memory, so every param's bytes, derived (concatenated) ones included, can be compared with the checkpoint's."""

import threading
from collections import Counter
from collections.abc import Mapping

import numpy as np
import pytest

from pegainfer.frontends.checkpoint import derive
from pegainfer.frontends.load import load_model
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.gpu.upload import plan_pieces, stream_pieces


def run_upload(model, graph, weights, chunk: int, buffers: int):
    device = np.zeros(1 << 24, np.uint8)
    top = [0]

    def take(nbytes: int) -> int:
        top[0] += nbytes
        return top[0] - nbytes
    pieces, addresses, completes = plan_pieces(graph, weights, take, chunk=chunk)
    ring = [np.zeros(chunk, np.uint8) for _ in range(buffers)]
    busy: set[int] = set()
    lock = threading.Lock()

    def send(b: int, piece) -> None:
        with lock:
            assert b not in busy, "a buffer was sent again before its copy was done"
            busy.add(b)
        device[piece.dst: piece.dst + piece.nbytes] = ring[b][: piece.nbytes]

    def wait_free(b: int) -> None:
        busy.discard(b)
    order: list[int] = []
    stream_pieces(pieces, ring, send, wait_free, readers=3, sent=order.append)
    assert order == list(range(len(pieces)))
    assert [name for name in completes if name] == list(addresses)
    return device, addresses, pieces


def check_every_param(model, graph, device, addresses) -> None:
    derivations = graph.derivations()
    for name in graph.expanded_params():
        sources = derivations[name].sources if name in derivations else (name,)
        expected = np.concatenate([np.asarray(model.weights[s]).reshape(-1).view(np.uint8) for s in sources])
        got = device[addresses[name]: addresses[name] + expected.size]
        np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.parametrize("lazy", [True, False], ids=["file spans", "arrays"])
def test_every_param_lands_whole_through_a_small_ring(tiny_checkpoint, lazy):
    model = load_model(tiny_checkpoint, lazy=lazy)
    graph, _ = lower(model.spec.graph)
    device, addresses, pieces = run_upload(model, graph, model.weights, chunk=1000, buffers=3)
    assert len(pieces) > 3 * len(addresses) // 2, "small chunks: most params span several pieces"
    assert all((p.span is not None) == lazy for p in pieces)
    check_every_param(model, graph, device, addresses)


@pytest.mark.parametrize("quantization", [None, "fp8"], ids=["bf16 weights", "fp8 weights"])
def test_kv_cache_scales_the_checkpoint_lacks_are_uploaded_with_their_defaults(tiny_checkpoint, quantization):
    model = load_model(tiny_checkpoint, lazy=True, quantization=quantization, kv_cache_dtype="fp8")
    graph, _ = lower(model.spec.graph)
    filled = [name for name in graph.expanded_params() if name.endswith(("k_scale", "v_scale"))]
    assert filled, "an FP8 cache reads a K and a V scale a layer"
    device, addresses, _ = run_upload(model, graph, model.weights, chunk=1000, buffers=3)
    check_every_param(model, graph, device, addresses)


class CastOnLoad(Mapping):
    """Lazy weights with no file spans (each would need a cast): every tensor goes through an ArraySource."""

    def __init__(self, weights) -> None:
        self.weights, self.expected, self.loads = weights, weights.expected, Counter()

    def __getitem__(self, name: str) -> np.ndarray:
        self.loads[name] += 1
        return self.weights[name]

    def __iter__(self):
        return iter(self.expected)

    def __len__(self) -> int:
        return len(self.expected)


def test_a_tensor_needing_a_cast_is_loaded_once_and_dropped_after_its_last_piece(tiny_checkpoint):
    model = load_model(tiny_checkpoint, lazy=True)
    graph, _ = lower(model.spec.graph)
    weights = CastOnLoad(model.weights)
    device, addresses, pieces = run_upload(model, graph, weights, chunk=1000, buffers=3)
    assert all(p.span is None for p in pieces) and set(weights.loads.values()) == {1}
    assert all(p.source._bytes is None for p in pieces), "no tensor stays in host memory after its pieces"
    check_every_param(model, graph, device, addresses)


def test_kv_b_rows_dequantized_at_load_land_as_the_reference_derives_them(checkpoint_factory):
    """An FP8 latent-attention checkpoint: kv_b's key and value rows are made on the host (dequantized, then their
    rows taken) and sent whole; every other param lands as its file's bytes."""
    folder = checkpoint_factory("deepseek_v3_grouped_fp8", quantization="fp8-block",
                                architecture="DeepseekV3ForCausalLM")
    model = load_model(folder, lazy=True)
    graph, _ = lower(model.spec.graph)
    derivations = graph.derivations()
    made = {name for name, d in derivations.items() if d.dequantize is not None}
    assert made and all(".kv_b_proj." in name for name in made)
    device, addresses, _ = run_upload(model, graph, model.weights, chunk=1000, buffers=3)
    for name in made:
        expected = np.ascontiguousarray(derive(derivations[name], model.weights)).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(device[addresses[name]: addresses[name] + expected.size], expected, name)
    for name in [n for n in graph.expanded_params() if n not in made]:
        sources = derivations[name].sources if name in derivations else (name,)
        expected = np.concatenate([np.asarray(model.weights[s]).reshape(-1).view(np.uint8) for s in sources])
        np.testing.assert_array_equal(device[addresses[name]: addresses[name] + expected.size], expected, name)


@pytest.mark.parametrize("form", ["fp8-channel", "online"])
def test_regrouped_fp8_rows_and_their_scales_land_as_the_reference_derives_them(checkpoint_factory, form):
    """Qwen3.5's q_proj regrouped at load from an FP8 checkpoint (or quantized at load): its e4m3 rows and its
    scales' rows land regrouped, every param as the reference derives it."""
    from golden_configs import GOLDEN_CONFIGS

    overrides = GOLDEN_CONFIGS["qwen3_5_hybrid"][1]
    folder = checkpoint_factory("qwen3_5_hybrid", overrides) if form == "online" else \
        checkpoint_factory("qwen3_5_fp8_channel", overrides, architecture="Qwen3_5ForCausalLM",
                           quantization="fp8-channel")
    model = load_model(folder, lazy=True, quantization="fp8" if form == "online" else None)
    graph, _ = lower(model.spec.graph)
    derivations = graph.derivations()
    assert any(name.endswith("q_proj.weight.grouped_scale") for name in derivations)
    device, addresses, _ = run_upload(model, graph, model.weights, chunk=1000, buffers=3)
    for name in graph.expanded_params():
        made = derive(derivations[name], model.weights) if name in derivations else model.weights[name]
        expected = np.ascontiguousarray(made).reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(device[addresses[name]: addresses[name] + expected.size], expected, name)
