"""Tiny random models of the causal LM families transformers ships, one config each (no downloads).

SLIDING families get a window of WINDOW tokens, so a 40-token run goes well past it. UNROLLABLE families
keep a state a rollback cannot cut back (recurrent, linear-attention or chunked layers): the engine must
refuse them by name before any work.
"""

from __future__ import annotations

import torch
import transformers as T

VOCAB = 96
WINDOW = 8
_ATTENTION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
_COMMON = dict(
    tie_word_embeddings=False,
    vocab_size=VOCAB,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    max_position_embeddings=256,
)


def _llama_like(cls, **extra):
    return lambda: cls(**_ATTENTION, **_COMMON, **extra)


FAMILIES = {
    "llama": _llama_like(T.LlamaConfig),
    "qwen2": _llama_like(T.Qwen2Config),
    "qwen2-sliding": _llama_like(T.Qwen2Config, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": _llama_like(T.Qwen3Config, head_dim=8),
    "mistral-sliding": _llama_like(T.MistralConfig, sliding_window=WINDOW),
    "mixtral-sliding": _llama_like(T.MixtralConfig, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "starcoder2-sliding": _llama_like(T.Starcoder2Config, sliding_window=WINDOW),
    "gemma": _llama_like(T.GemmaConfig, head_dim=8),
    "gemma2": _llama_like(T.Gemma2Config, head_dim=8, sliding_window=WINDOW),  # soft-capped logits too
    "gemma3": _llama_like(T.Gemma3TextConfig, head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2),
    "phi3": _llama_like(T.Phi3Config),
    "phi": _llama_like(T.PhiConfig),
    "olmo": _llama_like(T.OlmoConfig),
    "olmo2": _llama_like(T.Olmo2Config),
    "granite": _llama_like(T.GraniteConfig),
    "gpt2": lambda: T.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=256, **_without_positions()),
    "gpt_neox": lambda: T.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **_COMMON
    ),
    "falcon": lambda: T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **_COMMON),
    "bloom": lambda: T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **_without_positions()),
    "mpt": lambda: T.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=256, **_without_positions()),  # ALiBi
    "falcon-alibi": lambda: T.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, **_COMMON
    ),
    "opt": lambda: T.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32, **_COMMON
    ),
}
SLIDING = [name for name in FAMILIES if name.endswith("-sliding") or name in ("gemma2", "gemma3")]

UNROLLABLE = {
    "mamba": lambda: T.MambaConfig(hidden_size=32, num_hidden_layers=2, state_size=4, **_without_positions()),
    "jamba": lambda: T.JambaConfig(
        **_ATTENTION,
        **_without_positions(),
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        num_experts=2,
        mamba_d_state=4,
        mamba_dt_rank=4,
    ),
}


def _without_positions() -> dict:
    return {key: value for key, value in _COMMON.items() if key != "max_position_embeddings"}


def build(name: str, seed: int = 0):
    """A random float32 model of the family. Weights are drawn at unit scale (embeddings N(0, 1), Linears
    N(0, 1/fan_in)) rather than the families' small init, which makes many of them repeat one token forever:
    a varied output makes rows reject drafts at different places."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(seed)
    config = {**FAMILIES, **UNROLLABLE}[name]()
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0, 1.0)
            elif isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features**-0.5)
            elif isinstance(module, Conv1D):  # GPT-2's Linear, its weight transposed: [in, out]
                module.weight.normal_(0, module.weight.shape[0] ** -0.5)
    return model
