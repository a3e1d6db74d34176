"""The decode GEMM variants (dot_16, gemv_1 and gemv_4 share the slot of up to 4 rows: `pegainfer tune`
chooses between them on a GPU; dot_16 also takes up to 16), each against the kernel's ops run by their references,
under TRITON_INTERPRET, on the plain projection, the fused residual add + RMSNorm + QKV projection and the gate/up
projection with its SiLU x up epilogue."""

import dataclasses

import numpy as np
import pytest
import torch

from pegainfer.backends.build import plan_model
from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.triton.execute import launch_kernel, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.frontends.load import embedded_configs, load_spec
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.registry import get_op
from pegainfer.models import qwen3
from pegainfer.passes.pipeline import lower

ROWS = 3


def one_layer(hidden: int, intermediate: int, head_dim: int):
    config = qwen3.Config(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                          rope_theta=1e4, attention_bias=False, tie_word_embeddings=True, torch_dtype="float32")
    return lower(qwen3.build_graph(config))[0]


@pytest.fixture(scope="module")
def graph():
    return one_layer(64, 96, 16)


def run_reference(node, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The kernel's inner ops in order, each by its NumPy reference."""
    env = dict(env)
    for inner in node.attrs["nodes"]:
        results = get_op(inner.op).reference(*(env[v] for v in inner.inputs), **inner.attrs)
        env.update(zip(inner.outputs, results if isinstance(results, tuple) else (results,)))
    return env


def variant_case(graph, kind: str, variant: str, max_rows: int, seed: int, scale: float = 1.0):
    """The first kernel of `kind`, planned with only `variant` of the slot of `max_rows` rows (one name may serve two
    slots), serving any row count, random inputs of ROWS rows, and the outputs of its ops' references."""
    body = next(g for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL and n.attrs["kind"] == kind)
    node = next(n for n in body.nodes if n.op == KERNEL and n.attrs["kind"] == kind)
    spec = plan_kernel(body, node, PlanOptions(block_size=16))
    (picked,) = [v for v in spec.variants if v.name == variant and v.max_rows == max_rows]
    chosen = dataclasses.replace(spec, variants=[dataclasses.replace(picked, max_rows=None)])
    types = body.value_types()
    rng = np.random.default_rng(seed)
    inputs = {v: scale * rng.standard_normal([ROWS if isinstance(d, str) else d for d in types[v].shape])
              .astype(np.float32) for v in node.inputs}
    return node, chosen, inputs, run_reference(node, inputs)


@pytest.mark.parametrize("kind", ["linear", "add_rms_norm_linear", "add_rms_norm_linear_silu_mul"])
@pytest.mark.parametrize("variant, max_rows", [("dot_16", 4), ("gemv_1", 4), ("gemv_4", 4), ("dot_16", 16)])
def test_decode_gemm_variant_matches_the_reference(graph, kind, variant, max_rows):
    node, chosen, inputs, expected = variant_case(graph, kind, variant, max_rows, seed=4)
    got = launch_kernel(chosen, node, {name: to_torch(a) for name, a in inputs.items()}, {"tokens": ROWS})
    for name in node.outputs:
        np.testing.assert_allclose(to_numpy(got[name]), expected[name], rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("name", sorted(embedded_configs()))
def test_every_planned_triton_grid_fits_cuda_limits(name):
    """A grid's second and third dimensions stop at 65535 programs on CUDA: a column tile too narrow for a
    vocabulary-wide projection fails at launch (seen on the H200 with 2-column tiles over 151936 columns)."""
    _, kernels = plan_model(load_spec(embedded_configs()[name]), PlanOptions())
    for kernel in kernels:
        for variant in kernel.variants:
            rows = variant.max_rows or 8192
            for launch in variant.launches:
                sizes = {symbol: rows for dim in launch.grid for symbol in dim.factors if isinstance(symbol, str)}
                grid = [dim.size(sizes) for dim in launch.grid]
                assert max(grid[1:], default=1) <= 65535, (kernel.node, variant.name, launch.function, grid)


@pytest.fixture(scope="module")
def wide_graph():
    """K of 1024 (hidden, and heads x head_dim): enough K tiles for the split variants to cut K in two."""
    return one_layer(1024, 1024, 256)


@pytest.mark.parametrize("kind", ["linear", "add_rms_norm_linear_silu_mul"])
@pytest.mark.parametrize("variant, max_rows", [("split_k_16", 4), ("split_k_16", 16)])
def test_split_gemm_matches_the_reference_and_leaves_its_tickets_zeroed(wide_graph, kind, variant, max_rows):
    """Twice on the same scratch: each launch's last program per tile must reset the tile's ticket, or the second
    launch would never find its last program (the sums' planes are overwritten, not added to)."""
    # inputs of 0.1: gates of a few units, not hundreds
    node, chosen, inputs, expected = variant_case(wide_graph, kind, variant, max_rows, seed=5, scale=0.1)
    assert chosen.variants[0].launches[-1].constexprs["SPLIT"] > 1
    scratch = {name: torch.zeros(shape, dtype=torch.float32 if dtype == "f32" else torch.int32)
               for name, (dtype, shape) in chosen.scratch.items() if name.startswith("gemm.split")}
    env = {name: to_torch(a) for name, a in inputs.items()} | scratch
    for _ in range(2):
        got = launch_kernel(chosen, node, env, {"tokens": ROWS})
        for name in node.outputs:
            scale = np.abs(expected[name]).max()  # sums of 1024 unit products, in another order than NumPy's
            np.testing.assert_allclose(to_numpy(got[name]), expected[name], rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=name)
        assert not scratch["gemm.split_count"].any()
