"""Random Qwen3 configurations (overrides of models/qwen3.py's TINY_CONFIG) that the golden tests cover."""

# Random configurations the golden tests cover: tied and untied heads, non-power-of-two sizes, head_dim 64 with a
# single KV head, q/k/v/o biases, several rope thetas and norms' eps.
QWEN3_CONFIGS = {
    "tiny_tied": {},
    "odd_single_kv": {"hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64,
                      "intermediate_size": 200, "vocab_size": 389, "num_hidden_layers": 3,
                      "tie_word_embeddings": False, "rope_theta": 1_000_000.0},
    "biased_untied": {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
                      "intermediate_size": 72, "vocab_size": 300, "attention_bias": True,
                      "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 500.0},
}

