"""Drafters that read the target's hidden states: the target's features (the residual stream entering chosen layers,
the final norm of every token) against transformers' hidden states; an EAGLE-3 head's graph against a torch
reference of the published architecture; speculation with it gives the tokens of decoding without it (greedy and
seeded, attention-only and hybrid targets, prefix-cache hits), its drafts mapped through d2t; bad heads refused in
one line."""

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from drain import drain
from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.fixtures.draft_heads import make_eagle3_head
from pegainfer.frontends.drafter_load import load_draft_head
from pegainfer.frontends.features import FEATURES, with_final_hidden, with_layer_inputs
from pegainfer.frontends.load import load_model
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.step import SLOT_POOL, has_recurrent_state
from pegainfer.runtime.batch import Chunk, Sequence, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.proposers import make_speculator
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
from pegainfer.runtime.speculative import parse_speculative_config

PROMPT = [5, 17, 99, 3, 250, 11, 7, 42, 9]


def run_once(graph, weights, ids: list[int], extra: dict | None = None) -> dict[str, np.ndarray]:
    """Every output of one prefill of `ids`, logits at every token."""
    allocator = BlockAllocator(32, 4, state_slots=2 if has_recurrent_state(graph) else 0)
    inputs = pack_step([Chunk(Sequence(0, ids), len(ids))], allocator, all_logits=True) | (extra or {})
    sizes = {"num_blocks": 32, "block_size": 4, SLOT_POOL: allocator.state_rows}
    states = {n: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for n, t in graph.expanded_states().items()}
    return dict(zip(graph.outputs, run_graph(graph, inputs, weights, states)))


def hf_hidden_states(folder, ids: list[int]) -> list[np.ndarray]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


def test_the_target_features_are_transformers_hidden_states(checkpoint_factory):
    folder = checkpoint_factory("llama3_scaled")  # 2 layers
    model = load_model(folder)
    hidden = hf_hidden_states(folder, PROMPT)
    logits = run_once(model.spec.graph, model.weights, PROMPT)[model.spec.graph.outputs[0]]
    for graph, expected in ((with_layer_inputs(model.spec.graph, [0, 1, 1]), np.concatenate(hidden[:2] + [hidden[1]],
                                                                                                -1)),
                            (with_final_hidden(model.spec.graph), hidden[-1])):
        outputs = run_once(graph, model.weights, PROMPT)
        np.testing.assert_allclose(outputs[FEATURES], expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(outputs[graph.outputs[0]], logits)  # the cut changes nothing else


def test_a_layer_inside_a_body_of_several_is_refused(checkpoint_factory):
    model = load_model(checkpoint_factory("gemma3_pattern_tail"))
    with pytest.raises(ConfigError, match="decoder layer 4 is inside a body of 2 layers"):
        with_layer_inputs(model.spec.graph, [4])


def eagle3_reference(weights: dict[str, np.ndarray], config: dict, ids: list[int], aux: np.ndarray) -> np.ndarray:
    """The published EAGLE-3 head in torch, float32: logits over the draft vocabulary at every position."""
    w = {name: torch.from_numpy(np.asarray(value, np.float32)) for name, value in weights.items()}
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * w[name]
    hidden = torch.from_numpy(aux) @ w["fc.weight"].T
    embeds = w["model.embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat([rms(embeds, "midlayer.input_layernorm.weight"), rms(hidden, "midlayer.hidden_norm.weight")], -1)
    tokens = len(ids)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(tokens, heads, dim).transpose(0, 1)[None]
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(tokens, kv_heads, dim).transpose(0, 1)[None]
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(tokens, kv_heads, dim).transpose(0, 1)[None]
    inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim ** -0.5)
    residual = hidden + attended[0].transpose(0, 1).reshape(tokens, heads * dim) @ w["midlayer.self_attn.o_proj.weight"].T
    normed = rms(residual, "midlayer.post_attention_layernorm.weight")
    mlp = (torch.nn.functional.silu(normed @ w["midlayer.mlp.gate_proj.weight"].T)
           * (normed @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    return (rms(residual + mlp, "norm.weight") @ w["lm_head.weight"].T).numpy()


def test_the_eagle3_head_matches_a_torch_reference_of_the_published_layer(checkpoint_factory, tmp_path):
    folder = checkpoint_factory("tiny_tied")
    head_folder = make_eagle3_head(folder, tmp_path / "head", layers=[0, 1, 1], draft_vocab=200)
    head = load_draft_head(head_folder, load_model(folder))
    hidden = hf_hidden_states(folder, PROMPT)
    aux = np.concatenate([hidden[0], hidden[1], hidden[1]], -1)
    # the head at position p reads the token at p + 1 and the target's features at p
    logits = run_once(head.first, head.weights, PROMPT[1:], {"features": aux[:-1]})[head.first.outputs[0]]
    expected = eagle3_reference(head.weights, json.loads((head_folder / "config.json").read_text()), PROMPT[1:],
                                aux[:-1])
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())
    assert head.target_layers == [0, 1, 1] and list(head.to_target[:3]) == [0, 2, 4]


def serve(model, work, config=None, head=None, spare: int = 0, prefix_cache: bool = False, kv_tokens: int = 2048,
          kept: list | None = None):
    """(each request's tokens, the scheduler's stats, every draft); `kept` gets, after each proposal, the most
    rows of target features a sequence's drafter holds."""
    engine = ReferenceEngine(model, max_tokens=kv_tokens, block_size=4, max_seqs=8, spare_states=spare)
    speculator = None
    if config is not None:
        given = config | ({"model": str(head)} if head is not None else {})
        speculator = make_speculator(parse_speculative_config(given), model, "cpu", 2048, 8, engine=engine)
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                               max_model_len=256, prefix_cache=prefix_cache),
                          speculator)
    proposed: list[int] = []
    if speculator is not None:  # record every draft
        propose = speculator.proposer.propose
        speculator.proposer.propose = lambda requests: [proposed.extend(d) or d for d in propose(requests)]
        if kept is not None:
            def propose_and_count(requests, drafts=speculator.proposer.propose):
                made = drafts(requests)
                kept.append(max((len(d.features) for d in speculator.proposer.drafts.values()), default=0))
                return made
            speculator.proposer.propose = propose_and_count
    for i, (prompt, params) in enumerate(work):
        scheduler.add(EngineRequest(str(i), list(prompt), params))
    made = drain(scheduler)
    return {str(i): [t.token_id for t in made[str(i)]] for i in range(len(work))}, scheduler.stats, proposed


def workload() -> list:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 500, 20).tolist()  # a prefix every request shares: prefix-cache hits
    return [(shared + rng.integers(0, 500, int(rng.integers(2, 12))).tolist(),
             SamplingParams(temperature=float(i % 2), seed=i, max_tokens=14, ignore_eos=True)) for i in range(5)]


@pytest.mark.parametrize("name, layers", [("tiny_tied", [0, 1, 1]), ("qwen3_5_hybrid", [0, 2, 3])])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_eagle3_speculation_gives_the_tokens_of_decoding_without_it(checkpoint_factory, tmp_path, name, layers,
                                                                    prefix_cache):
    folder = checkpoint_factory(name)
    model = load_model(folder)
    head = make_eagle3_head(folder, tmp_path / "head", layers=layers, draft_vocab=100)
    expected, _, _ = serve(model, workload(), prefix_cache=prefix_cache)
    kept: list[int] = []
    found, stats, proposed = serve(model, workload(), {"method": "eagle3", "num_speculative_tokens": 3}, head,
                                   spare=8, prefix_cache=prefix_cache, kept=kept)
    assert found == expected
    assert stats.spec_draft_tokens > 0 and proposed and all(t % 2 == 0 and t < 200 for t in proposed)  # via d2t
    # rows a sequence's drafter holds: a prompt's (up to 31 tokens) until its first proposal, then a step's few
    assert max(kept[len(workload()):]) <= 3 + 1 and max(kept) <= 31


def test_a_target_giving_features_serves_alone_as_without_them(checkpoint_factory, tmp_path):
    """The features graph (as serve builds it before its engine) with no speculator on the scheduler: the same
    tokens, the features left unread."""
    from pegainfer.runtime.drafter_graphs import with_drafter_features

    folder = checkpoint_factory("tiny_tied")
    model = load_model(folder)
    head = make_eagle3_head(folder, tmp_path / "head", layers=[0, 1, 1])
    config = parse_speculative_config({"method": "eagle3", "num_speculative_tokens": 2, "model": str(head)})
    featured = with_drafter_features(config, model)
    assert FEATURES in featured.spec.graph.outputs
    assert serve(featured, workload())[0] == serve(model, workload())[0]


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_hidden_state_drafters_through_preemption_give_the_tokens_of_decoding_without_them(
        checkpoint_factory, tmp_path, mtp_checkpoint, method):
    """A pool of 40 blocks for five sequences of up to ~45 tokens: sequences are preempted and recomputed, their
    drafters' state rebuilt from the target's features of the recomputed positions."""
    folder = checkpoint_factory("tiny_tied") if method == "eagle3" else mtp_checkpoint
    model = load_model(folder)
    head = make_eagle3_head(folder, tmp_path / "head", layers=[0, 1, 1]) if method == "eagle3" else None
    expected, _, _ = serve(model, workload(), kv_tokens=160)
    found, stats, _ = serve(model, workload(), {"method": method, "num_speculative_tokens": 3}, head,
                            spare=8, kv_tokens=160)
    assert found == expected and stats.preemptions > 0 and stats.spec_draft_tokens > 0


@pytest.mark.parametrize("edit, error, message", [
    (lambda c, d: c | {"vocab_size": 300}, ConfigError, "vocabulary has 300 tokens, the target's 512"),
    (lambda c, d: c | {"target_hidden_size": 32}, ConfigError, "reads hidden states of 32, the target's are 64"),
    (lambda c, d: c | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, ConfigError,
     r"three target layers within 0..1, found \[0, 1, 9\]"),
    (lambda c, d: c | {"architectures": ["MedusaModel"]}, ConfigError, "'MedusaModel' is not a draft head"),
    (lambda c, d: (d / "model.safetensors").unlink() or c, CheckpointError, "safetensors"),
])
def test_bad_heads_are_refused_in_one_line(checkpoint_factory, tmp_path, edit, error, message):
    folder = checkpoint_factory("tiny_tied")
    head = make_eagle3_head(folder, tmp_path / "head", layers=[0, 1, 1], draft_vocab=100)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(edit(config, head)))
    with pytest.raises(error, match=message) as caught:
        load_draft_head(head, load_model(folder))
    assert "\n" not in str(caught.value)


def test_a_head_without_its_vocabulary_map_is_refused(checkpoint_factory, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = checkpoint_factory("tiny_tied")
    head = make_eagle3_head(folder, tmp_path / "head", layers=[0, 1, 1], draft_vocab=100)
    tensors = load_file(head / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"needs 'd2t' \[100\], found None"):
        load_draft_head(head, load_model(folder))
    shutil.rmtree(head)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A small Qwen3.5 checkpoint whose safetensors also hold a random one-layer MTP head (mtp.*)."""
    from safetensors.numpy import load_file, save_file

    from pegainfer.fixtures.checkpoint import make_checkpoint
    from pegainfer.frontends.load import load_spec

    folder = make_checkpoint(tmp_path_factory.mktemp("mtp"), "Qwen3_5ForCausalLM",
                             {"mtp_num_hidden_layers": 1, "tie_word_embeddings": False})
    spec = load_spec(folder / "config.json")
    rng = np.random.default_rng(0)
    head = {name: (rng.standard_normal(t.shape) * (0.05 if name.endswith("norm.weight") else 0.3)).astype(np.float32)
            for name, t in spec.dag.mtp_params(spec.config).items()}
    save_file(load_file(folder / "model.safetensors") | head, str(folder / "model.safetensors"))
    return folder


def mtp_reference(model, ids: list[int], features: np.ndarray) -> np.ndarray:
    """The head in torch: transformers' own decoder layer (full attention) between the published fc and norms."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    config = transformers.AutoConfig.from_pretrained(model.folder)
    text = getattr(config, "text_config", config)
    text.layer_types = ["full_attention"] * len(text.layer_types)
    text._attn_implementation = "eager"
    w = {name: torch.from_numpy(np.asarray(value, np.float32)) for name, value in {**model.mtp,
                                                                                 **model.weights}.items()}

    def norm(x, name):  # 1 + weight, as every norm of the model
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + text.rms_norm_eps) * (1 + w[f"mtp.{name}.weight"])
    layer = qwen.Qwen3_5DecoderLayer(text, 0).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")})
    embeds = w["model.embed_tokens.weight"][torch.tensor(ids)]
    x = torch.cat([norm(embeds, "pre_fc_norm_embedding"), norm(torch.from_numpy(features), "pre_fc_norm_hidden")],
                  -1) @ w["mtp.fc.weight"].T
    positions = torch.arange(len(ids))[None]
    rotary = qwen.Qwen3_5TextRotaryEmbedding(text)
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = layer(x[None], rotary(x[None], positions), attention_mask=mask, position_ids=positions)[0]
    return (norm(x, "norm") @ w["lm_head.weight"].T).numpy()


def test_the_mtp_head_matches_transformers_layer_between_its_norms(mtp_checkpoint):
    from pegainfer.frontends.checkpoint import derive_weights

    model = load_model(mtp_checkpoint)
    head = model.spec.dag.mtp_graph(model.spec.config)
    weights = derive_weights(head.derivations(), {**model.mtp, **model.weights})
    target = with_final_hidden(model.spec.graph)
    features = run_once(target, derive_weights(target.derivations(), model.weights), PROMPT)[FEATURES]
    logits = run_once(head, weights, PROMPT[1:], {"features": features[:-1]})[head.outputs[0]]
    expected = mtp_reference(model, PROMPT[1:], features[:-1])
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())


def test_mtp_speculation_gives_the_tokens_of_decoding_without_it(mtp_checkpoint):
    model = load_model(mtp_checkpoint)
    expected, _, _ = serve(model, workload())
    found, stats, proposed = serve(model, workload(), {"method": "mtp", "num_speculative_tokens": 2}, None, spare=8)
    assert found == expected and stats.spec_draft_tokens > 0 and proposed


def test_mtp_without_a_head_is_refused(checkpoint_factory):
    model = load_model(checkpoint_factory("qwen3_5_hybrid"))
    with pytest.raises(ConfigError, match="needs the model's MTP head.*its checkpoint has none"):
        make_speculator(parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1}), model, "cpu", 64, 1)


@pytest.fixture(scope="module")
def deepseek_mtp(checkpoint_factory, tmp_path_factory):
    """The small DeepSeek-V3 checkpoint with a random MTP layer (model.layers.<L>.*) beside its layers."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path_factory.mktemp("dsv3_mtp")
    shutil.copytree(checkpoint_factory("deepseek_v3_grouped"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    spec = load_model(folder).spec
    rng = np.random.default_rng(1)
    head = {name: (rng.standard_normal(t.shape) * (0.05 if "norm" in name or "bias" in name else 0.3)
                   ).astype(np.float32) + (1.0 if name.endswith("norm.weight") else 0.0)
            for name, t in spec.dag.mtp_params(spec.config).items()}
    save_file(load_file(folder / "model.safetensors") | head, str(folder / "model.safetensors"))
    return folder


def deepseek_mtp_reference(model, ids: list[int], features: np.ndarray) -> np.ndarray:
    """The MTP layer in torch around transformers' own decoder layer at its index."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    config = transformers.AutoConfig.from_pretrained(model.folder)
    config._attn_implementation = "eager"
    index = config.num_hidden_layers
    prefix = f"model.layers.{index}."
    w = {name: torch.from_numpy(np.asarray(value, np.float32)) for name, value in model.mtp.items()}

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w[f"{prefix}{name}.weight"]
    layer = deepseek.DeepseekV3DecoderLayer(config, index).eval()
    state = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix) and ".experts." not in k and
             k[len(prefix):].startswith(("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))}
    experts = range(config.n_routed_experts)  # transformers keeps the experts fused
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"{prefix}mlp.experts.{e}.gate_proj.weight"],
                                                                w[f"{prefix}mlp.experts.{e}.up_proj.weight"]])
                                                     for e in experts])
    state["mlp.experts.down_proj"] = torch.stack([w[f"{prefix}mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(state)
    embeds = w[f"{prefix}embed_tokens.weight"][torch.tensor(ids)]
    embeds[0] = 0  # the head drops the embedding at position 0
    x = torch.cat([norm(embeds, "enorm"), norm(torch.from_numpy(features), "hnorm")], -1) @ w[f"{prefix}eh_proj.weight"].T
    positions = torch.arange(len(ids))[None]
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = layer(x[None], attention_mask=mask, position_ids=positions,
                  position_embeddings=deepseek.DeepseekV3RotaryEmbedding(config)(x[None], positions))[0]
    return (norm(x, "shared_head.norm") @ w[f"{prefix}shared_head.head.weight"].T).numpy()


def test_the_deepseek_mtp_layer_matches_transformers_layer_and_speculates_exactly(deepseek_mtp):
    from pegainfer.frontends.checkpoint import derive_weights

    model = load_model(deepseek_mtp)
    head = model.spec.dag.mtp_graph(model.spec.config)
    weights = derive_weights(head.derivations(), dict(model.mtp))
    target = with_final_hidden(model.spec.graph)
    features = run_once(target, derive_weights(target.derivations(), model.weights), PROMPT)[FEATURES]
    gate = {"features": features[:-1], "embed_gate": (np.arange(len(PROMPT) - 1) != 0).astype(np.float32)[:, None]}
    logits = run_once(head, weights, PROMPT[1:], gate)[head.outputs[0]]
    expected = deepseek_mtp_reference(model, PROMPT[1:], features[:-1])
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())
    baseline, _, _ = serve(model, workload())
    found, stats, _ = serve(model, workload(), {"method": "mtp", "num_speculative_tokens": 2}, None)
    assert found == baseline and stats.spec_draft_tokens > 0
