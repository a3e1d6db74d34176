"""Random configurations (overrides of each DAG file's TINY_CONFIG) that the golden tests cover, by name:
(architecture, overrides)."""

# Qwen3: tied and untied heads, non-power-of-two sizes, head_dim 64 with a single KV head, q/k/v/o biases, several
# rope thetas and norms' eps.
QWEN3_CONFIGS = {
    "tiny_tied": {},
    "odd_single_kv": {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64,
                      "intermediate_size": 200, "vocab_size": 389, "num_hidden_layers": 3,
                      "tie_word_embeddings": False, "rope_theta": 1_000_000.0},
    "biased_untied": {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
                      "intermediate_size": 72, "vocab_size": 300, "attention_bias": True,
                      "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 500.0},
}

# The other architectures: what each adds (llama3 RoPE scaling, biases, sliding windows shorter than the prompts,
# Gemma's local/global layers, MoE routing with and without renormalised weights), at the smallest sizes.
ARCH_CONFIGS = {
    "llama3_scaled": ("LlamaForCausalLM", {}),
    "llama_tied_mlp_bias": ("LlamaForCausalLM", {
        "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None,
        "intermediate_size": 80, "tie_word_embeddings": True, "mlp_bias": True, "attention_bias": True,
        "rope_scaling": None, "rope_theta": 10000.0}),
    "qwen2_biased": ("Qwen2ForCausalLM", {}),
    "qwen2_window_layers": ("Qwen2ForCausalLM", {"num_hidden_layers": 3, "use_sliding_window": True,
                                                 "sliding_window": 6, "max_window_layers": 1, "head_dim": 32}),
    "mistral_window": ("MistralForCausalLM", {}),
    "gemma3_local_global": ("Gemma3ForCausalLM", {}),
    "gemma3_pattern_tail": ("Gemma3ForCausalLM", {
        "num_hidden_layers": 5, "layer_types": ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"],
        "sliding_window": 4, "query_pre_attn_scalar": 24, "tie_word_embeddings": False}),
    "qwen3_moe_topk": ("Qwen3MoeForCausalLM", {}),
    "qwen3_moe_normalized_sparse": ("Qwen3MoeForCausalLM", {"norm_topk_prob": True, "num_experts_per_tok": 3,
                                                            "decoder_sparse_step": 2, "num_hidden_layers": 3}),
    # Qwen3.5: linear-attention layers beside full ones; grouped value heads, odd head counts, one KV head, the
    # layer pattern from full_attention_interval; the multimodal wrappers served by their text stacks
    "qwen3_5_hybrid": ("Qwen3_5ForCausalLM", {}),
    "qwen3_5_odd_heads": ("Qwen3_5ForCausalLM", {
        "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 32,
        "linear_num_key_heads": 1, "linear_num_value_heads": 3, "linear_key_head_dim": 8, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 3, "num_hidden_layers": 5, "layer_types": None, "full_attention_interval": 2,
        "tie_word_embeddings": False, "intermediate_size": 80, "rms_norm_eps": 1e-5}),
    "qwen3_5_wrapper": ("Qwen3_5ForConditionalGeneration", {"tie_word_embeddings": False}),
    # Qwen3.5-MoE: routed experts renormalised plus the gated shared expert, in every layer
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {}),
    "qwen3_5_moe_wrapper": ("Qwen3_5MoeForConditionalGeneration", {"num_hidden_layers": 2, "layer_types": [
        "linear_attention", "full_attention"], "num_experts_per_tok": 3}),
    "gemma3_wrapper": ("Gemma3ForConditionalGeneration", {}),
}

GOLDEN_CONFIGS: dict[str, tuple[str, dict]] = {
    **{name: ("Qwen3ForCausalLM", overrides) for name, overrides in QWEN3_CONFIGS.items()}, **ARCH_CONFIGS}
