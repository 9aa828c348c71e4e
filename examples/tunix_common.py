"""Shared pieces of the Tunix examples (`tunix_grpo.py`, `bench_tunix.py`): the embedded SmolLM2 as a
Tunix `Llama3` model (its weights copied through a `weight_sync` mapping, no file written), and the
engine's tokenizer with the methods Tunix's tokenizer adapter calls.

Tunix 0.1.7's Llama 3 applies RoPE with base 1e6 whatever its config says; SmolLM2 was trained with
1e5, so through Tunix's class it is a slightly different model than through Hugging Face's (the
engine serves what Tunix trains: `rollout/integrations/tunix_models.py`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tunix.models.llama3 import model as llama3

import weight_sync
from rollout.tokenizer import Tokenizer, load_tokenizer
from runner.models.loader import load_model
from weight_sync.rules import Rule


class TunixTokenizer:
    """The engine's tokenizer with `encode` / `decode` / `bos_id` / `eos_id` / `pad_id` (Tunix's interface)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, **kw: Any) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], **kw: Any) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def bos_id(self) -> int:
        return self.tokenizer.bos_token_id or 0

    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def pad_id(self) -> int:
        """SmolLM2's `<|endoftext|>` (0), never in a chat prompt: Tunix masks every pad-valued token, and
        the tokenizer's own pad (`<|im_end|>`, its EOS) ends every chat turn."""
        return 0


def _engine_to_tunix(hidden: int, heads: int, kv_heads: int, head_dim: int) -> tuple[Rule, ...]:
    """The engine's Llama names and `[in, out]` kernels -> Tunix's Llama3 (einsum-shaped attention)."""
    return (
        Rule("embed_tokens", "embedder.input_embedding"),
        Rule("layers.*.self_attn.q_proj.kernel", "layers.*.attn.q_proj.w", reshape=(hidden, heads, head_dim)),
        Rule("layers.*.self_attn.k_proj.kernel", "layers.*.attn.k_proj.w", reshape=(hidden, kv_heads, head_dim)),
        Rule("layers.*.self_attn.v_proj.kernel", "layers.*.attn.v_proj.w", reshape=(hidden, kv_heads, head_dim)),
        Rule("layers.*.self_attn.o_proj.kernel", "layers.*.attn.o_proj.w", reshape=(heads, head_dim, hidden)),
        Rule("layers.*.mlp.*.kernel", "layers.*.mlp.*.kernel"),
        Rule("layers.*.*.scale", "layers.*.*.w"),
        Rule("norm.scale", "final_norm.w"),
        Rule("lm_head.kernel", "lm_head.w"),
    )


def smollm2_as_tunix(mesh: Mesh | None = None) -> tuple[nnx.Module, TunixTokenizer]:
    """The embedded SmolLM2-135M-Instruct as a Tunix `Llama3` (float32), and its tokenizer."""
    ours, cfg = load_model(None)
    config = llama3.ModelConfig(num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
                                hidden_dim=cfg.intermediate_size, num_heads=cfg.num_attention_heads,
                                head_dim=cfg.head_dim, num_kv_heads=cfg.num_key_value_heads,
                                rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
                                weight_tying=cfg.tie_word_embeddings)
    mesh = mesh or Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    with mesh:
        model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    source, target = nnx.state(ours, nnx.Param), nnx.state(model, nnx.Param)
    rules = _engine_to_tunix(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    weight_sync.apply(weight_sync.plan(source, target, rules), source, target)
    return model, TunixTokenizer(load_tokenizer(None))
