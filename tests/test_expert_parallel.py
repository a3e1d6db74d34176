"""Expert parallelism (vLLM's --enable-expert-parallel) proven on the CPU: routed experts split whole across the
ranks (rank r holding experts [r E / w, (r + 1) E / w)) beside tensor-parallel attention and shared experts, every
rank's graph loaded with only its experts' tensors, all ranks run together by the rank-aware interpreter, against
the unsharded graph: the same logits (float32, relative error under 1e-5) for a packed prefill and a decode step.
FP8 experts move whole with their scales; splitting them inside stays refused, as are experts the ranks do not
divide, each in one line."""

import re
from collections import defaultdict
from math import prod

import pytest

from golden_configs import GOLDEN_CONFIGS
from pegainfer.errors import ConfigError
from pegainfer.frontends import checkpoint as checkpoint_module
from pegainfer.frontends.load import load_model, load_spec
from pegainfer.passes.shard import Parallelism
from test_tensor_parallel import TOLERANCE, check_sharded, make, relative_error, run_sharded, unsharded_logits

MOE_CASES = [name for name, (architecture, _) in GOLDEN_CONFIGS.items() if "Moe" in architecture or
             "Deepseek" in architecture]
EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's tensor (shared experts are `shared_expert(s).`)


@pytest.mark.parametrize("name", MOE_CASES)
def test_expert_parallel_ranks_give_the_unsharded_logits(checkpoint_factory, name):
    check_sharded(name, make(checkpoint_factory, name), (2, 4), expert_parallel=True)


def test_lowered_expert_parallel_ranks_give_the_unsharded_logits(checkpoint_factory):
    """The passes after sharding (fusion, kernel formation) keep a rank's held experts."""
    folder = make(checkpoint_factory, "deepseek_v3_grouped")
    steps, expected = unsharded_logits(folder)
    for ranks, reference in zip(run_sharded(folder, 2, steps, lowered=True, expert_parallel=True), expected):
        assert max(relative_error(logits, reference) for logits in ranks) < TOLERANCE


@pytest.mark.parametrize("name", ["deepseek_v2_grouped_yarn", "qwen3_5_moe"])
def test_a_moe_block_sums_its_routed_and_shared_experts_in_one_all_reduce(checkpoint_factory, name):
    """Each sparse layer reduces twice: its mixer's output projection, then its routed and (gated) shared experts
    together."""
    spec = load_spec(make(checkpoint_factory, name) / "config.json", parallel=Parallelism(2, 0, expert_parallel=True))
    sparse = [g for g in spec.graph.subgraphs.values() if any(n.op == "moe_experts" for n in g.nodes)]
    assert sparse
    for body in sparse:
        reduced = [n.outputs[0] for n in body.nodes if n.op == "all_reduce"]
        assert reduced[0] in ("o_proj", "out_proj") and reduced[1:] == ["moe_out"], body.name


def read_tensors(monkeypatch) -> dict[str, int]:
    """name -> bytes, of every tensor the loader reads from now on."""
    read: dict[str, int] = {}
    real = checkpoint_module._read

    def counting(handle, name, *args, **kwargs):
        data = real(handle, name, *args, **kwargs)
        read[name] = data.nbytes
        return data
    monkeypatch.setattr(checkpoint_module, "_read", counting)
    return read


def experts_read(read: dict[str, int]) -> dict[int, int]:
    """Bytes read of each routed expert, over all layers."""
    by_expert: dict[int, int] = defaultdict(int)
    for name, nbytes in read.items():
        found = EXPERT.search(name)
        if found:
            by_expert[int(found.group(1))] += nbytes
    return by_expert


@pytest.mark.parametrize("name, world", [("qwen3_moe_topk", 2), ("qwen3_5_moe", 4), ("deepseek_v2_grouped_yarn", 2)])
def test_each_rank_reads_only_its_experts(checkpoint_factory, monkeypatch, name, world):
    """Rank r reads experts r E / w .. (r + 1) E / w - 1 and no other, each as much as the unsharded load reads of
    it (fused checkpoints too: Qwen3.5-MoE's per-layer [experts, ...] tensors, read an expert's rows at a time)."""
    folder = make(checkpoint_factory, name)
    read = read_tensors(monkeypatch)
    load_model(folder)
    whole = experts_read(read)
    experts = len(whole)
    per = experts // world
    for rank in range(world):
        read.clear()
        model = load_model(folder, parallel=Parallelism(world, rank, expert_parallel=True))
        mine = experts_read(read)
        assert sorted(mine) == list(range(rank * per, (rank + 1) * per))
        assert all(mine[e] == whole[e] for e in mine)
        held = sum(prod(t.shape) * t.dtype.itemsize for n, t in model.spec.graph.checkpoint_params().items()
                   if EXPERT.search(n))
        assert held == sum(mine.values()) == sum(whole.values()) // world


def test_fp8_experts_move_whole_under_expert_parallelism(checkpoint_factory, monkeypatch):
    """Block-scaled FP8 experts: each rank's weights and scales of its own experts alone, the logits unchanged
    (the FP8 projections outside the experts stay whole on every rank: sliced FP8 tensors are not read yet)."""
    folder = checkpoint_factory("qwen3_moe_fp8-block", quantization="fp8-block", architecture="Qwen3MoeForCausalLM")
    read = read_tensors(monkeypatch)
    model = load_model(folder, parallel=Parallelism(2, 1, expert_parallel=True))
    held = {n for n in read if EXPERT.search(n)}
    assert held and {int(EXPERT.search(n).group(1)) for n in held} == {4, 5, 6, 7}
    assert any(n.endswith("down_proj.weight_scale_inv") for n in held)
    assert model.spec.graph.checkpoint_params()["model.layers.0.mlp.experts.5.down_proj.weight"].dtype.name == "f8e4m3"
    check_sharded("qwen3_moe_fp8-block", folder, (2,), expert_parallel=True)


def test_fp8_experts_split_inside_are_refused_in_one_line(checkpoint_factory):
    folder = checkpoint_factory("qwen3_moe_fp8-block", quantization="fp8-block", architecture="Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="experts over FP8 or unstacked weights are not implemented") as error:
        load_model(folder, parallel=Parallelism(2, 0))
    assert "\n" not in str(error.value)


def test_experts_the_ranks_cannot_divide_are_refused_naming_their_count(checkpoint_factory):
    folder = checkpoint_factory("qwen3_moe_six_experts", {"num_experts": 6}, architecture="Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match=r"expert parallelism over 4 ranks: .*experts\.gate_up_proj\.weight stacks "
                                          r"6 experts, which do not divide into 4 parts") as error:
        load_model(folder, parallel=Parallelism(4, 0, expert_parallel=True))
    assert "\n" not in str(error.value)
    model = load_model(folder, parallel=Parallelism(2, 1, expert_parallel=True))  # 3 each for 2 ranks
    assert {int(EXPERT.search(n).group(1)) for n in model.spec.graph.checkpoint_params() if EXPERT.search(n)} == \
        {3, 4, 5}
