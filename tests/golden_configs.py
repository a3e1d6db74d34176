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
    # DeepSeek-V2 / V3 (MLA + MoE): with and without a query LoRA, greedy and group-limited softmax routing,
    # sigmoid routing with the score bias and top-2 group scores, a dense first layer, YaRN with an attention
    # factor and its mscale in the softmax scale, interleaved and rotate-half rope
    "deepseek_v2_greedy": ("DeepseekV2ForCausalLM", {}),
    "deepseek_v2_grouped_yarn": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 3, "routed_scaling_factor": 16.0, "n_shared_experts": 1,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}}),
    "deepseek_v3_grouped": ("DeepseekV3ForCausalLM", {}),
    "deepseek_v3_yarn_ungrouped": ("DeepseekV3ForCausalLM", {
        "q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "first_k_dense_replace": 0,
        "num_hidden_layers": 2, "rope_interleave": False, "vocab_size": 300,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
}

GOLDEN_CONFIGS: dict[str, tuple[str, dict]] = {
    **{name: ("Qwen3ForCausalLM", overrides) for name, overrides in QWEN3_CONFIGS.items()}, **ARCH_CONFIGS}
