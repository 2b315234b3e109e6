"""Tiny random Hugging Face models, the reference the model code's parity tests and benchmarks/model.py compare
against. Importing this sets nothing (conftest.py sets the suite's XLA flags for everything after it)."""

import numpy as np

# Tiny random Hugging Face configs covering what the loader must get right: q/k/v bias + tied embeddings (Qwen2),
# q/k norm with head_dim != hidden/heads (Qwen3), GQA 4:1 + Llama-3 RoPE scaling (Llama).
HF_CONFIGS = {
    "qwen2": dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24),
    "llama": dict(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, rope_theta=5e5,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=16)),
}


def make_hf_model(family: str, **overrides):
    """A random tiny transformers model (fp32, eval mode) of `family`, weights perturbed beyond HF's init."""
    import torch
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls[family](**{**HF_CONFIGS[family], **overrides}))
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: perturb so every tensor matters
            p.add_(0.05 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()
