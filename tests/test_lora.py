"""LoRA adapters on the CPU engine: PEFT's own adapters (random, non-zero, ranks 8 and 64) on Qwen3 and Llama give
PEFT's logits (float32, 1e-4) at a prefill and 16 decode steps and its greedy tokens; a batch mixing rows of three
adapters and of none gives every row what it gives alone; a prefix-cache hit never crosses adapters; adapters
swap through fewer slots than adapters; bad adapters are refused in one line."""

import json
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers

from drain import drain
from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.frontends.load import load_model
from pegainfer.frontends.lora import LoraConfig, lora_model, lora_modules, read_adapter, with_lora
from pegainfer.runtime.lora import LoraSlots
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 99, 3, 250, 11, 7, 42]


def make_adapter(base: Path, out: Path, rank: int, seed: int, targets=TARGETS, rslora: bool = False) -> Path:
    """A PEFT adapter of `base` with random non-zero A and B (PEFT starts B at zero: nothing to test)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora)
    tuned = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    for name, param in tuned.named_parameters():
        if "lora_" in name:
            param.data = torch.randn(param.shape, generator=generator) * (0.3 / np.sqrt(param.shape[-1]))
    tuned.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).eval()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logprobs, every step recomputed from the whole sequence (no EOS rule)."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], -1).numpy()
            logprobs.append(row)
            tokens.append(int(np.argmax(row)))
    return tokens[len(prompt):], logprobs


def serving(model, adapters: dict[str, Path], config: LoraConfig = LoraConfig(3, 64), kv_tokens: int = 4096,
            prefix_cache: bool = False, steps_logits: bool = False):
    graph = with_lora(model.spec.graph, config)
    engine = ReferenceEngine(model, max_tokens=kv_tokens, block_size=4, graph=graph, max_seqs=8)
    slots = LoraSlots(graph, config, engine.write_lora)
    for name, path in adapters.items():
        slots.register(read_adapter(name, path, graph, config))
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                               max_model_len=256, prefix_cache=prefix_cache),
                          lora=slots)
    return scheduler, engine


def run(scheduler, work: list[tuple[list[int], str | None]], max_tokens: int = 16) -> dict[str, list]:
    for i, (prompt, lora) in enumerate(work):
        scheduler.add(EngineRequest(str(i), list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                        logprobs=5), lora=lora))
    made = drain(scheduler)
    return {str(i): [(t.token_id, t.logprobs) for t in made[str(i)]] for i in range(len(work))}


@pytest.fixture(scope="module")
def adapters(checkpoint_factory, tmp_path_factory):
    made = {}
    for name in ("tiny_tied", "llama3_scaled"):
        base = checkpoint_factory(name)
        for rank in (8, 64):
            made[(name, rank)] = make_adapter(base, tmp_path_factory.mktemp(f"{name}_{rank}"), rank, seed=rank)
    return made


@pytest.mark.parametrize("name", ["tiny_tied", "llama3_scaled"])
@pytest.mark.parametrize("rank", [8, 64])
def test_adapters_give_peft_logits_and_greedy_tokens(checkpoint_factory, adapters, name, rank):
    base = checkpoint_factory(name)
    reference = peft_model(base, adapters[(name, rank)])
    expected_tokens, expected = greedy(reference, PROMPT, 16)
    scheduler, _ = serving(load_model(base), {"a": adapters[(name, rank)]})
    (found,) = run(scheduler, [(PROMPT, "a")]).values()
    assert [t for t, _ in found] == expected_tokens
    for (_, logprobs), reference_row in zip(found, expected):
        ids = list(logprobs)
        np.testing.assert_allclose([logprobs[i] for i in ids], reference_row[ids], rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the adapter changes the model: its logits are not the base's
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        assert not np.allclose(plain(torch.tensor([PROMPT])).logits[0, -1].numpy(),
                               reference(torch.tensor([PROMPT])).logits[0, -1].numpy(), atol=1e-2)


def test_a_batch_of_three_adapters_and_the_base_gives_every_row_what_it_gives_alone(checkpoint_factory,
                                                                                    tmp_path):
    base = checkpoint_factory("tiny_tied")
    made = {name: make_adapter(base, tmp_path / name, rank, seed, targets)
            for name, rank, seed, targets in (("a", 8, 1, TARGETS), ("b", 16, 2, ["q_proj", "v_proj"]),
                                              ("c", 4, 3, ["down_proj", "o_proj"]))}
    model = load_model(base)
    rng = np.random.default_rng(0)
    work = [(rng.integers(0, 500, int(rng.integers(3, 20))).tolist(), [None, "a", "b", "c"][i % 4])
            for i in range(8)]
    scheduler, _ = serving(model, made)
    together = run(scheduler, work)
    for i, item in enumerate(work):
        alone, _ = serving(model, made)
        (tokens,) = run(alone, [item]).values()
        assert [t for t, _ in together[str(i)]] == [t for t, _ in tokens]
        for (_, mine), (_, theirs) in zip(together[str(i)], tokens):
            np.testing.assert_allclose(list(mine.values()), list(theirs.values()), rtol=1e-5, atol=1e-5)


def test_adapters_swap_through_fewer_slots_and_prefix_hits_stay_within_an_adapter(checkpoint_factory, tmp_path):
    base = checkpoint_factory("tiny_tied")
    made = {name: make_adapter(base, tmp_path / name, 8, seed) for seed, name in enumerate("abc")}
    model = load_model(base)
    shared = list(range(100, 140))  # ten full blocks every request starts with
    work = [(shared + [7 + i], name) for i, name in enumerate(["a", None, "b", "c", "a", None])]
    scheduler, _ = serving(model, made, LoraConfig(max_loras=1, max_rank=8), prefix_cache=True)
    found = run(scheduler, work, max_tokens=6)
    assert scheduler.lora.loads >= 3  # one slot: every other adapter written over the last
    for i, item in enumerate(work):  # a cold run of each alone, no prefix cache
        cold, _ = serving(model, made, LoraConfig(max_loras=1, max_rank=8))
        (tokens,) = run(cold, [item], max_tokens=6).values()
        assert [t for t, _ in found[str(i)]] == [t for t, _ in tokens], f"request {i} ({item[1]})"
    # requests 4 and 5 repeat the adapters of 0 and 1: their prefix is found; the other adapters' never is
    assert scheduler.cache.hits == 2 * 40


def test_rslora_scaling_matches_peft(checkpoint_factory, tmp_path):
    base = checkpoint_factory("tiny_tied")
    adapter = make_adapter(base, tmp_path / "rs", 16, 5, rslora=True)
    expected_tokens, expected = greedy(peft_model(base, adapter), PROMPT, 4)
    scheduler, _ = serving(load_model(base), {"rs": adapter})
    (found,) = run(scheduler, [(PROMPT, "rs")], max_tokens=4).values()
    assert [t for t, _ in found] == expected_tokens
    for (_, logprobs), row in zip(found, expected):
        np.testing.assert_allclose(list(logprobs.values()), row[list(logprobs)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("edit, error, message", [
    (lambda c, t: (c | {"r": 32}, t), ConfigError, "rank 32 exceeds --max-lora-rank 16"),
    (lambda c, t: (c | {"use_dora": True}, t), ConfigError, "no DoRA"),
    (lambda c, t: (c | {"bias": "all"}, t), ConfigError, 'bias "none"'),
    (lambda c, t: (c, {k.replace("layers.0.self_attn.q_proj", "layers.9.self_attn.q_proj"): v for k, v in t.items()}),
     ConfigError, "targets model.layers.9.self_attn.q_proj, which this model has no LoRA table for"),
    (lambda c, t: (c, {k: (v[:, :-1] if "q_proj.lora_A" in k else v) for k, v in t.items()}), CheckpointError,
     r"model.layers.0.self_attn.q_proj needs lora_A \[8, 64\]"),
])
def test_bad_adapters_are_refused_in_one_line(checkpoint_factory, tmp_path, edit, error, message):
    from safetensors.numpy import load_file, save_file

    base = checkpoint_factory("tiny_tied")
    folder = make_adapter(base, tmp_path / "bad", 8, 0)
    config, tensors = edit(json.loads((folder / "adapter_config.json").read_text()),
                           load_file(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    graph = with_lora(load_model(base).spec.graph, LoraConfig(2, 16))
    with pytest.raises(error, match=message) as caught:
        read_adapter("bad", folder, graph, LoraConfig(2, 16))
    assert "\n" not in str(caught.value)


def test_serving_two_adapters_and_the_base_loading_and_unloading_at_run_time(checkpoint_factory, tmp_path):
    import httpx
    import openai

    from live_server import NAME, start_server, stop_server

    base = checkpoint_factory("tiny_tied")
    first, second = make_adapter(base, tmp_path / "a", 8, 1), make_adapter(base, tmp_path / "b", 16, 2)
    server = start_server(base, "--enable-lora", "--lora-modules", f"a={first}", "--max-loras", "2",
                          "--max-lora-rank", "16", log=tmp_path / "serve.log")
    try:
        client = server.client()
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {NAME, "a"} and cards["a"].parent == NAME and cards["a"].root == str(first)
        prompt = list(range(100, 140))  # ten full blocks of 4 tokens: prefix-cache hits to count

        def complete(model: str) -> tuple[str, int]:
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
            return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens
        plain, _ = complete(NAME)
        tuned, crossed = complete("a")
        again, hit = complete("a")
        assert tuned != plain and again == tuned
        assert crossed == 0 and hit > 0  # the base's blocks never serve the adapter; its own do
        scheduler, _ = serving(load_model(base), {"a": first})
        (offline,) = run(scheduler, [(prompt, "a")], max_tokens=8).values()
        from pegainfer.runtime.detokenize import decode_completion
        from pegainfer.runtime.tokenizer import load_tokenizer

        assert tuned == decode_completion(load_tokenizer(base), prompt, [t for t, _ in offline])
        with pytest.raises(openai.NotFoundError, match="`b` does not exist"):
            complete("b")
        loaded = server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(second)})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert complete("b")[0] not in (plain, tuned)
        assert server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(second)}).status_code == 400
        bad = server.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
        with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": "Bearer test-key"},
                          timeout=60, json={"model": "b", "prompt": prompt, "max_tokens": 300, "stream": True,
                                            "ignore_eos": True}) as stream:
            lines = stream.iter_lines()  # held: a closed iterator would close the stream, aborting the request
            next(line for line in lines if line.startswith("data: {"))
            busy = server.post("/v1/unload_lora_adapter", {"lora_name": "b"})
        assert busy.status_code == 400 and "in use" in busy.json()["error"]["message"]
        unloaded = server.post("/v1/unload_lora_adapter", {"lora_name": "b"})
        assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
        assert {card.id for card in client.models.list().data} == {NAME, "a"}
        assert server.post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
        # the name again, over a's weights: the old b's cached blocks of the prompt never serve it
        assert server.post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(first)}).status_code == 200
        assert complete("b") == (tuned, 0)
    finally:
        stop_server(server)


def lora_graph(rows_in: int, rows_out: int, slots: int, rank: int, dtype, add: bool, normed: bool = False):
    """x's update (`add`: added in place to the input `base`; `normed`: of x normalised by the weight `norm`)."""
    from pegainfer.ir import GraphBuilder
    from pegainfer.ir.dtypes import FP32, INT32

    b = GraphBuilder("lora")
    base = b.input("base", dtype, ("tokens", rows_out)) if add else None
    x = b.input("x", dtype, ("tokens", rows_in))
    lora_slots = b.input("lora_slots", INT32, ("tokens",))
    a = b.state("a", dtype, (slots, rank, rows_in))
    table_b = b.state("b", dtype, (slots, rows_out, rank))
    scale = b.state("scale", FP32, (slots,))
    if normed:
        norm = b.input("norm", dtype, (rows_in,))
        return b.finish(b.lora_add(base, x, a, table_b, scale, lora_slots, norm, eps=1e-5, name="update"))
    if add:
        return b.finish(b.lora_add(base, x, a, table_b, scale, lora_slots, name="update"))
    return b.finish(b.lora(x, a, table_b, scale, lora_slots, name="update"))


DECODE_SLOTS = [2, 2, 2, 2, 2, -1, 0, 2, -1, 3, 2, 2, 0]  # slot 1 has no rows; 2 most of them
CHUNK_SLOTS = [2] * 32 + [-1] * 32 + [0, 0, 3, -1, 0, 2]  # blocks of 32: one adapter's, the base's, mixed


@pytest.mark.parametrize("slots", [DECODE_SLOTS, CHUNK_SLOTS], ids=["decode", "chunks"])
@pytest.mark.parametrize("form", ["lora", "lora_add", "lora_add_normed"])
@pytest.mark.parametrize("dtype_name", ["f32", "bf16"])
@pytest.mark.parametrize("rows_in, rows_out, rank", [(64, 96, 8), (200, 130, 64), (48, 20, 5), (96, 144, 192),
                                                     (700, 40, 16)])
def test_the_lora_kernels_match_the_reference_with_rows_spread_unevenly(dtype_name, rows_in, rows_out, rank, form,
                                                                        slots):
    """The shrink's slices of K (700: three, the last partial) summed by the expand, with the sums of squares of
    a normalised input; lora_add leaves the base rows of slot -1 as they were and writes the others in place.
    A decode step's rows one by one, a longer step's in blocks (tensor-core products where a block has one slot)."""
    from pegainfer.backends.planning import PlanOptions
    from pegainfer.backends.triton.execute import launch_kernel, to_numpy, to_torch
    from pegainfer.backends.triton.plan import plan_kernel
    from pegainfer.ir import dtype_from_name
    from pegainfer.ir.graph import KERNEL
    from pegainfer.ir.ops.lora import _lora
    from pegainfer.passes.pipeline import lower

    dtype = dtype_from_name(dtype_name)
    rng = np.random.default_rng(rank)
    slots = np.array(slots, np.int32)
    arrays = dict(x=rng.standard_normal((len(slots), rows_in)), a=rng.standard_normal((4, rank, rows_in)) * 0.2,
                  b=rng.standard_normal((4, rows_out, rank)) * 0.2)
    arrays = {name: a.astype(dtype.np_dtype) for name, a in arrays.items()}
    add, normed = form != "lora", form == "lora_add_normed"
    base = rng.standard_normal((len(slots), rows_out)).astype(dtype.np_dtype)
    norm = (1 + 0.5 * rng.standard_normal(rows_in)).astype(dtype.np_dtype)
    scale = np.array([0.5, 2.0, 1.5, 0.25], np.float32)
    x = arrays["x"].astype(np.float32)
    if normed:
        x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-5) * norm.astype(np.float32)
    want = _lora(x, arrays["a"], arrays["b"], scale, slots) + (base.astype(np.float32) if add else 0)
    lowered, _ = lower(lora_graph(rows_in, rows_out, 4, rank, dtype, add, normed))
    (node,) = [n for n in lowered.nodes if n.op == KERNEL]
    env = {name: to_torch(a) for name, a in arrays.items()} | {"scale": to_torch(scale), "base": to_torch(base),
                                                               "lora_slots": to_torch(slots), "norm": to_torch(norm)}
    out = launch_kernel(plan_kernel(lowered, node, PlanOptions()), node, env, {"tokens": len(slots)})[node.outputs[0]]
    got = to_numpy(out).astype(np.float32)
    bound = 1e-5 if dtype_name == "f32" else 2e-2
    assert np.abs(got - want).max() <= bound * np.abs(want).max()
    if add:
        assert out.data_ptr() == env["base"].data_ptr()  # in place
        assert np.array_equal(got[slots == -1], base[slots == -1].astype(np.float32))  # untouched
    else:
        assert not got[slots == -1].any()  # the base model's rows take nothing


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_lowered_lora_model_runs_its_generated_kernels_as_the_reference_and_compiles_for_sm_90(
        checkpoint_factory, tmp_path, quantization):
    """Tiny Qwen3 with two adapters' tables (its projections in bf16, or quantized to FP8 at load): a packed step
    of rows of both adapters and the base through the Triton kernels under the interpreter equals the reference
    interpreter; the LoRA launches compile for sm_90."""
    from pegainfer.backends.build import compile_many
    from pegainfer.backends.planning import PlanOptions
    from pegainfer.backends.triton.execute import InterpretedExecutor, to_torch
    from pegainfer.backends.triton.plan import plan_kernel
    from pegainfer.frontends.checkpoint import derive_weights
    from pegainfer.frontends.lora import adapter_rows
    from pegainfer.ir.graph import KERNEL
    from pegainfer.ir.interpreter import run_graph
    from pegainfer.passes.pipeline import lower
    from pegainfer.runtime.batch import Chunk, Sequence, pack_step
    from pegainfer.runtime.kv_blocks import BlockAllocator

    base = checkpoint_factory("tiny_tied")
    model = load_model(base, quantization=quantization)
    config = LoraConfig(2, 16)
    graph = with_lora(model.spec.graph, config)
    lowered, _ = lower(graph)
    assert any(n.op == KERNEL and n.attrs["kind"] == "lora_add" for g in lowered.all_graphs() for n in g.nodes)
    sizes = {"num_blocks": 16, "block_size": 4}
    states = {n: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for n, t in lowered.expanded_states().items()}
    for slot, (name, seed) in enumerate((("a", 1), ("b", 2))):
        adapter = read_adapter(name, make_adapter(base, tmp_path / name, 8 * (slot + 1), seed), graph, config)
        for table, row in adapter_rows(adapter, graph).items():
            states[table][slot] = row
    seqs = [Sequence(i, list(range(10 * i + 3, 10 * i + 3 + n)), lora_slot=slot)
            for i, (n, slot) in enumerate(((5, 0), (3, -1), (6, 1)))]
    inputs = pack_step([Chunk(s, len(s.token_ids)) for s in seqs], BlockAllocator(16, 4), lora=True)
    weights = derive_weights(lowered.derivations(), model.weights)
    expected = run_graph(lowered, inputs, weights, {n: s.copy() for n, s in states.items()})[0]
    declared = run_graph(graph, inputs, model.weights, {n: s.copy() for n, s in states.items()})[0]
    assert np.abs(expected - declared).max() < 1e-5 * np.abs(declared).max()  # passes, lora_add included
    specs = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=4)) for g in lowered.all_graphs()
             for n in g.nodes if n.op == KERNEL}
    got = InterpretedExecutor(lowered, specs).run(inputs, weights, {n: to_torch(s) for n, s in states.items()})[0]
    assert np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()
    todo = {(90, (spec.node, launch.function)): launch for spec in specs.values() if spec.kind == "lora_add"
            for variant in spec.variants for launch in variant.launches}
    compiled = dict(compile_many(todo, jobs=2, progress=None))
    assert compiled.keys() == todo.keys() and all(result.cubin for result in compiled.values())


def test_an_update_written_into_a_part_of_a_merged_gemm_keeps_its_rows_stride(checkpoint_factory):
    """DeepSeek-V2 merges q_proj with kv_a_proj_with_mqa, so q_proj's lora_add writes in place into a column
    slice of the merged output: its kernels, and those reading q after it, take the merged rows' stride. The
    lowered graph's Triton kernels under the interpreter against the reference interpreter, random tables."""
    from pegainfer.backends.planning import PlanOptions
    from pegainfer.backends.triton.execute import InterpretedExecutor, to_torch
    from pegainfer.backends.triton.plan import plan_kernel
    from pegainfer.frontends.checkpoint import derive_weights
    from pegainfer.ir.graph import KERNEL
    from pegainfer.ir.interpreter import run_graph
    from pegainfer.passes.pipeline import lower
    from pegainfer.runtime.batch import Chunk, Sequence, pack_step
    from pegainfer.runtime.kv_blocks import BlockAllocator

    model = load_model(checkpoint_factory("deepseek_v2_greedy"))
    lowered, _ = lower(with_lora(model.spec.graph, LoraConfig(2, 8)))
    rng = np.random.default_rng(0)
    states = {}
    for name, t in lowered.expanded_states().items():
        shape = t.concrete({"num_blocks": 16, "block_size": 4})
        scale = 0.5 if name.endswith("lora_scale") else 0.1 if ".lora_" in name else 0.0
        states[name] = (rng.standard_normal(shape) * scale).astype(t.dtype.np_dtype)
    seqs = [Sequence(i, list(range(10 * i + 3, 10 * i + 3 + n)), lora_slot=slot)
            for i, (n, slot) in enumerate(((5, 0), (3, -1), (6, 1)))]
    inputs = pack_step([Chunk(s, len(s.token_ids)) for s in seqs], BlockAllocator(16, 4), lora=True)
    weights = derive_weights(lowered.derivations(), model.weights)
    expected = run_graph(lowered, inputs, weights, {n: a.copy() for n, a in states.items()})[0]
    specs = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=4)) for g in lowered.all_graphs()
             for n in g.nodes if n.op == KERNEL}
    got = InterpretedExecutor(lowered, specs).run(inputs, weights, {n: to_torch(a) for n, a in states.items()})[0]
    assert np.abs(np.asarray(got, np.float32) - expected).max() < 1e-4 * np.abs(expected).max()


def test_a_lora_graph_has_its_own_manifest_and_its_padding_rows_take_no_adapter(checkpoint_factory):
    from pegainfer.backends.cache import model_id
    from pegainfer.ir.step import LORA_SLOTS
    from pegainfer.runtime.batch import Chunk, Sequence, pack_step
    from pegainfer.runtime.gpu.step_padding import pad_decode_step
    from pegainfer.runtime.kv_blocks import BlockAllocator

    model = load_model(checkpoint_factory("tiny_tied"), lazy=True)
    spec = model.spec
    plain, tuned = model_id(spec), model_id(lora_model(model, LoraConfig(4, 32)).spec)
    assert tuned.endswith("-lora4x32") and tuned.split("-")[1] != plain.split("-")[1]
    assert lora_model(model, LoraConfig(4, 32)).weights is model.weights  # the same weights under the new graph
    seqs = [Sequence(i, [5, 6], lora_slot=slot) for i, slot in enumerate((2, -1, 0))]
    step = pack_step([Chunk(s, 1) for s in seqs], BlockAllocator(8, 4), lora=True)
    assert list(pad_decode_step(step, 8)[LORA_SLOTS]) == [2, -1, 0, -1, -1, -1, -1, -1]


@pytest.mark.parametrize("form", ["fp8-block", "fp8-channel"])
def test_an_adapter_over_fp8_weights_gives_peft_on_the_dequantized_weights(checkpoint_factory, tmp_path, form):
    """The LoRA update reads the projection's input and adds to its output whatever the weight's storage: over a
    checkpoint's FP8 projections (each a dequantize + linear), PEFT on the dequantized weights in float32."""
    from test_fp8 import OVERRIDES, hf_on_dequantized

    base = checkpoint_factory(form, OVERRIDES, quantization=form)
    tuned = peft.get_peft_model(hf_on_dequantized(base), peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(5)
    for name, param in tuned.named_parameters():
        if "lora_" in name:
            param.data = torch.randn(param.shape, generator=generator) * (0.3 / np.sqrt(param.shape[-1]))
    tuned.save_pretrained(tmp_path / "adapter")
    expected_tokens, expected = greedy(tuned.eval(), PROMPT, 8)
    scheduler, _ = serving(load_model(base), {"a": tmp_path / "adapter"}, LoraConfig(1, 8))
    (found,) = run(scheduler, [(PROMPT, "a")], max_tokens=8).values()
    assert [t for t, _ in found] == expected_tokens
    for (_, logprobs), reference_row in zip(found, expected):
        ids = list(logprobs)
        np.testing.assert_allclose([logprobs[i] for i in ids], reference_row[ids], rtol=1e-4, atol=1e-4)


def test_a_qwen3_5_adapter_on_its_regrouped_q_proj_gives_peft_logits(checkpoint_factory, tmp_path):
    """Qwen3.5's q_proj rows (each head's q, then its gate) are regrouped at load: the adapter's B rows are
    regrouped alike, so its full-attention layers' updates, as every other projection's, give PEFT's logits."""
    base = checkpoint_factory("qwen3_5_hybrid")
    adapter = make_adapter(base, tmp_path / "a", 8, seed=4)
    reference = peft_model(base, adapter)
    expected_tokens, expected = greedy(reference, PROMPT, 8)
    model = load_model(base)
    assert any("self_attn.q_proj" in stem for stem in lora_modules(with_lora(model.spec.graph, LoraConfig(1, 8))))
    scheduler, _ = serving(model, {"a": adapter}, LoraConfig(1, 8))
    (found,) = run(scheduler, [(PROMPT, "a")], max_tokens=8).values()
    assert [t for t, _ in found] == expected_tokens
    for (_, logprobs), reference_row in zip(found, expected):
        ids = list(logprobs)
        np.testing.assert_allclose([logprobs[i] for i in ids], reference_row[ids], rtol=1e-4, atol=1e-4)


def test_lora_on_a_regrouped_projection_under_tensor_parallelism_is_refused_in_one_line(checkpoint_factory):
    from pegainfer.frontends.load import load_spec
    from pegainfer.passes.shard import Parallelism

    spec = load_spec(checkpoint_factory("qwen3_5_hybrid") / "config.json", parallel=Parallelism(2, 0, False))
    with pytest.raises(ConfigError, match=r"LoRA on model.layers.\{layer\+3\}.self_attn.q_proj, whose rows the "
                                          r"loader regroups, under tensor parallelism is not implemented"):
        with_lora(spec.graph, LoraConfig(1, 8))
