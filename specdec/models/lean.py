"""The llama family's forward (Llama, Qwen2, Mistral as transformers builds them) without transformers'
per-call plumbing, in gpt-fast's shape: one loop over the layers, the model's own modules and ops.

transformers' forward wraps every layer and attention call in decorators, keyword merging, output
capture and mask factories. This loop calls the same modules (embeddings, rotary, norms, Linears, MLPs,
head), the family's own `apply_rotary_pos_emb` and transformers' own sdpa attention, and repeats the
little glue between them (views, the cache update, residual adds) as transformers writes it, so the
logits are the same bit for bit (tests/test_lean.py compares them with torch.equal over chains, padded batches, trees
and rollbacks). It runs only where that holds: the families' own classes, sdpa attention,
no sliding window, one device, and nobody hooking or replacing the model's forward.
"""

from __future__ import annotations

import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}  # model_type -> class prefix


def _is_part(module: torch.nn.Module, family: str, part: str) -> bool:
    """Whether the module is exactly transformers' class for this part (no subclass, no other family)."""
    cls = type(module)
    home = f"transformers.models.{family}.modeling_{family}"
    return cls.__module__ == home and cls.__name__ == FAMILIES[family] + part


def lean_forward(model: torch.nn.Module) -> LeanForward | None:
    """The lean forward of a model whose every part is its family's own class; None for any other."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family not in FAMILIES or config._attn_implementation != "sdpa" or getattr(model, "hf_device_map", None):
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    layers = model.model.layers[: config.num_hidden_layers]
    parts = [(model, "ForCausalLM"), (model.model.norm, "RMSNorm")]
    for layer in layers:
        parts += [(layer, "DecoderLayer"), (layer.self_attn, "Attention"), (layer.mlp, "MLP")]
        parts += [(layer.input_layernorm, "RMSNorm"), (layer.post_attention_layernorm, "RMSNorm")]
    return LeanForward(model) if all(_is_part(m, family, part) for m, part in parts) else None


def sdpa_mask(mask: torch.Tensor | None, new: int, keys: int) -> torch.Tensor | None:
    """transformers' sdpa mask for `new` queries after `keys - new` cached slots: None where sdpa's own
    causal rule is exact (one query, or no cache), else bool [batch or 1, 1, new, keys]. A 2D mask
    [batch, keys] marks the real slots; a 4D one (a tree's) is used as it is."""
    if mask is not None and mask.dim() == 4:
        return mask
    padded = mask is not None and not bool(mask.all())
    if not padded and (new == 1 or new == keys):
        return None
    causal = torch.ones(new, keys, dtype=torch.bool).tril(keys - new)[None, None]
    return causal & mask.bool()[:, None, None, :] if padded else causal


class LeanForward:
    """forward(ids, mask, positions, cache, keep_logits) -> logits, as model(...).logits would give them."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        inner = model.model
        self.embed, self.rotary, self.norm, self.head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.rotate = sys.modules[type(model).__module__].apply_rotary_pos_emb  # the family's own

    def runs(self) -> bool:
        """False while someone hooks or replaces the model's forward: then transformers' forward runs."""
        hooks = torch.nn.modules.module
        watched = self.model._forward_hooks or self.model._forward_pre_hooks or "forward" in vars(self.model)
        return not (watched or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)

    def __call__(self, ids, mask, positions, cache, keep_logits: int) -> torch.Tensor:
        batch, new = ids.shape
        mask = sdpa_mask(mask, new, cache.get_seq_length() + new)
        mask = mask.to(ids.device) if mask is not None else None
        x = self.embed(ids)
        cos, sin = self.rotary(x, positions)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            heads = (batch, new, -1, attn.head_dim)
            q = attn.q_proj(h).view(heads).transpose(1, 2)
            k = attn.k_proj(h).view(heads).transpose(1, 2)
            v = attn.v_proj(h).view(heads).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            k, v = cache.update(k, v, index)
            out, _ = sdpa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)  # transformers' GQA choices
            x = x + attn.o_proj(out.reshape(batch, new, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(self.norm(x)[:, -keep_logits:])
