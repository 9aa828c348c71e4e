"""EAGLE-3 draft head: configuration, the one-layer model, and its paged and dense forwards.

The head drafts from the target's own features. At position p its input is
`g_p = fc(concat(aux_p))` (the target's residual stream entering a low, a middle and a high layer)
and the embedding of the token at p + 1; its one decoder layer attends over the head's own KV
cache and predicts the token at p + 2. Later drafting steps feed the head's own output (before
`norm`) back as the next position's `g`. Layer (Hugging Face EAGLE-3 / vLLM `llama_eagle3`):

    h = hidden_norm(g); e = input_layernorm(embed(token))
    x = g + o_proj(attention(q/k/v_proj(concat(e, h))))      # q/k/v read 2H features
    x = x + mlp(post_attention_layernorm(x))                 # the next step's g
    logits = lm_head(norm(x))                                # over the draft vocabulary

Draft token d maps to target id `d + d2t[d]`. A head without `lm_head` (or `embed_tokens`) uses
the target's, so `sync_weights` keeps those shared tensors current for free.

In the engine the head's KV cache is paged with the *target's* block tables: head position p
lives in the same slot as target position p (`DraftCache`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from runner.attention import MASK_VALUE, REFERENCE, AttentionKernel, AttentionMetadata, paged_attention, paged_slots
from runner.models.config import ModelConfig, RopeScaling
from runner.models.family import DraftTarget
from runner.models.embedding import embedding_rows
from runner.models.llama import MLP, Linear, RMSNorm, apply_rope, rope_inv_freq
from runner.sampler_blocks import argmax_last

def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's choice for Llama targets, clamped into range for very shallow (test) models."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Eagle3HeadConfig:
    """Hyper-parameters of one EAGLE-3 head (the published `config.json`)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    has_lm_head: bool = True  # False: logits from the target's output projection (draft vocab = vocab)
    has_embedding: bool = False  # True: the head's own `embed_tokens`, else the target's
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"an EAGLE-3 head fuses 3 target layers, got aux_layer_ids={self.aux_layer_ids}")
        if not self.has_lm_head and self.draft_vocab_size != self.vocab_size:
            raise ValueError("a head that shares the target's lm_head drafts over the whole vocabulary: "
                             f"draft_vocab_size {self.draft_vocab_size} != vocab_size {self.vocab_size}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target's vocab {self.vocab_size}")

    def model_config(self) -> ModelConfig:
        """The layer sizes as a `ModelConfig` (for the shared Linear / RMSNorm / MLP modules)."""
        return ModelConfig(family="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling, param_dtype=self.dtype, dtype=self.dtype)

    @classmethod
    def for_target(cls, target: ModelConfig, *, draft_vocab_size: int | None = None,
                   aux_layer_ids: tuple[int, ...] | None = None) -> "Eagle3HeadConfig":
        """A head shaped like one layer of `target` (the usual choice; the checkpoint's heads when the
        target's are padded for a mesh); `draft_vocab_size` None = shared lm_head."""
        layout = target.head_layout
        heads = ((target.num_attention_heads, target.num_key_value_heads) if layout is None
                 else (layout.num_source_heads, layout.num_source_kv_heads))
        return cls(hidden_size=target.hidden_size, num_attention_heads=heads[0],
                   num_key_value_heads=heads[1], head_dim=target.head_dim,
                   intermediate_size=target.intermediate_size, vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab_size or target.vocab_size, target_hidden_size=target.hidden_size,
                   aux_layer_ids=aux_layer_ids or default_aux_layers(target.num_hidden_layers),
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                   has_lm_head=draft_vocab_size is not None, dtype=target.dtype)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, object], *, has_lm_head: bool, has_embedding: bool,
                     num_target_layers: int, dtype: str = "float32") -> "Eagle3HeadConfig":
        """Read a published EAGLE-3 `config.json` (`LlamaForCausalLMEagle3`)."""
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            vocab = int(hf["vocab_size"])
            inter = int(hf["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"EAGLE-3 config.json lacks required field {e.args[0]!r}") from None
        eagle = hf.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        rs = hf.get("rope_scaling")
        scaling = None
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "llama3":
            scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"]),
                                  int(rs["original_max_position_embeddings"]))
        return cls(hidden_size=hidden, num_attention_heads=heads,
                   num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
                   head_dim=int(hf.get("head_dim") or hidden // heads), intermediate_size=inter, vocab_size=vocab,
                   draft_vocab_size=int(hf.get("draft_vocab_size") or vocab),
                   target_hidden_size=int(hf.get("target_hidden_size") or hidden),
                   aux_layer_ids=tuple(int(i) for i in aux) if aux else default_aux_layers(num_target_layers),
                   rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(hf.get("rope_theta", 10000.0)),
                   rope_scaling=scaling, has_lm_head=has_lm_head, has_embedding=has_embedding, dtype=dtype)

    def to_hf_dict(self) -> dict[str, object]:
        out: dict[str, object] = dict(
            architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size, target_hidden_size=self.target_hidden_size,
            num_hidden_layers=1, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, hidden_act="silu",
            tie_word_embeddings=False, torch_dtype=self.dtype,
            eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(self.aux_layer_ids)))
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = dict(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                                       high_freq_factor=s.high_freq_factor,
                                       original_max_position_embeddings=s.original_max_position_embeddings)
        return out


class Eagle3Attention(nnx.Module):
    """Grouped-query attention whose q/k/v projections read `[embedding ++ hidden]` (2H features)."""

    def __init__(self, cfg: Eagle3HeadConfig, rngs: nnx.Rngs):
        mc = cfg.model_config()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(2 * h, cfg.num_attention_heads * d, bias=False, cfg=mc, rngs=rngs)
        self.k_proj = Linear(2 * h, cfg.num_key_value_heads * d, bias=False, cfg=mc, rngs=rngs)
        self.v_proj = Linear(2 * h, cfg.num_key_value_heads * d, bias=False, cfg=mc, rngs=rngs)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=False, cfg=mc, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(mc)))

    def kv(self, x: Float[Array, "... 2H"], positions: Int[Array, "..."]
           ) -> tuple[Float[Array, "... Hkv D"], Float[Array, "... Hkv D"]]:
        lead = x.shape[:-1]
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        return apply_rope(k, positions, self.inv_freq[...]), v

    def q(self, x: Float[Array, "... 2H"], positions: Int[Array, "..."]) -> Float[Array, "... Hq D"]:
        q = self.q_proj(x).reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        return apply_rope(q, positions, self.inv_freq[...])


class Eagle3Layer(nnx.Module):
    """The head's one decoder layer (`midlayer.*` in the published layout)."""

    def __init__(self, cfg: Eagle3HeadConfig, rngs: nnx.Rngs):
        mc = cfg.model_config()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=mc)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=mc)
        self.self_attn = Eagle3Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=mc)
        self.mlp = MLP(mc, rngs)

    def features(self, embeds: Float[Array, "... H"], hidden: Float[Array, "... H"]) -> Float[Array, "... 2H"]:
        return jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(hidden)], axis=-1)

    def finish(self, hidden: Float[Array, "... H"], attn: Float[Array, "... Hq D"]) -> Float[Array, "... H"]:
        x = hidden + self.self_attn.o_proj(attn.reshape(*attn.shape[:-2], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nnx.Module):
    """fc (3 target features -> H), one layer, norm, and lm_head over the draft vocabulary."""

    def __init__(self, cfg: Eagle3HeadConfig, *, rngs: nnx.Rngs):
        mc = cfg.model_config()
        self.config = cfg
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False, cfg=mc, rngs=rngs)
        self.midlayer = Eagle3Layer(cfg, rngs)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=mc)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False, cfg=mc, rngs=rngs) \
            if cfg.has_lm_head else None
        init = jax.nn.initializers.normal(stddev=0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.dtype(cfg.dtype))) \
            if cfg.has_embedding else None
        self.d2t = nnx.Variable(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))  # target id = draft id + d2t

    def embed(self, target: DraftTarget, token_ids: Int[Array, "..."]) -> Float[Array, "... H"]:
        if self.embed_tokens is None:
            return target.embed(token_ids)
        return embedding_rows(self.embed_tokens[...], token_ids).astype(jnp.dtype(self.config.dtype))

    def logits(self, target: DraftTarget, x: Float[Array, "... H"]) -> Float[Array, "... Vd"]:
        """float32 logits over the draft vocabulary of a layer output `x` (before `norm`)."""
        h = self.norm(x)
        return (self.lm_head(h) if self.lm_head is not None else target.compute_logits(h)).astype(jnp.float32)

    def greedy_target_ids(self, logits: Float[Array, "... Vd"]) -> Int[Array, "..."]:
        d = argmax_last(logits)
        return d + self.d2t[...][d]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """The head's device state in the engine, addressed by the target's block tables and slots."""

    kv: Float[Array, "R 2 Hkv P page D"]  # the head layer's paged K/V (head position p = target slot of p)
    hidden: Float[Array, "R P page H"]  # g = fc(aux) of every position the target computed


def fill_cache(head: Eagle3Head, target: DraftTarget, kv: Float[Array, "2 Hkv P page D"],
               hidden: Float[Array, "P page H"], aux: Float[Array, "T A"], token_ids: Int[Array, "T"],
               positions: Int[Array, "T"], slot_mapping: Int[Array, "T"], prev_slots: Int[Array, "T"],
               kernel: AttentionKernel = REFERENCE) -> tuple[Float[Array, "2 Hkv P page D"], Float[Array, "P page H"]]:
    """After a target step (one replica): store g of every computed token, and the head's K/V at p - 1
    for every token fed at p (its next token is now known). Out-of-range slots are dropped. `kernel`:
    the head cache's (`AttentionKernel.head_kernel`)."""
    num_pages, page, width = hidden.shape
    flat = hidden.reshape(num_pages * page, width)
    flat = flat.at[slot_mapping].set(head.fc(aux).astype(flat.dtype), mode="drop")
    g_prev = jnp.take(flat, prev_slots, axis=0, mode="clip")
    k, v = head.midlayer.self_attn.kv(head.midlayer.features(head.embed(target, token_ids), g_prev), positions - 1)
    return kernel.write(kv, k, v, prev_slots), flat.reshape(hidden.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftChain:
    """Where each sequence's drafting stands after the head's first step (one replica)."""

    g: Float[Array, "S H"]  # that step's layer output: the next step's g
    token_ids: Int[Array, "S"]  # its draft (target id): the next step's input token
    confidence: Float[Array, "S"]  # the head's probability of that draft (0 at padding rows)


def draft_paged(head: Eagle3Head, target: DraftTarget, kv: Float[Array, "2 Hkv P page D"],
                hidden: Float[Array, "P page H"], last_token_ids: Int[Array, "S"], positions: Int[Array, "S"],
                page_indices: Int[Array, "S W"], num_seqs: Int[Array, "1"], *, num_steps: int,
                kernel: AttentionKernel = REFERENCE) -> tuple[Float[Array, "2 Hkv P page D"], Int[Array, "S K"], DraftChain]:
    """`num_steps` greedy drafts per sequence (one replica), as target ids `[S, num_steps]`.

    `last_token_ids[s]` is the token the coming target step feeds at position c, `positions[s]` is
    c - 1: step j runs the head at c - 1 + j (step 0 reads g_{c-1} from the cache, later steps the
    previous step's output) and writes its K/V there; the target step's `fill_cache` rewrites them.
    Returns the cache, the drafts and the chain after step 0 (its `confidence` decides unsure steps).
    `kernel`: the head cache's attention (`AttentionKernel.head_kernel`: the CPU backend's C++ kernel there, else
    the pure-JAX path).
    """
    num_pages, page, width = hidden.shape
    num_slots = num_pages * page
    num_rows = page_indices.shape[0]
    valid = jnp.arange(num_rows) < num_seqs[0]
    attn = head.midlayer.self_attn
    cu_q_lens = jnp.arange(num_rows + 1, dtype=jnp.int32)

    def slot_of(pos: Array) -> Array:
        return paged_slots(page_indices, pos, page, num_slots, valid)

    def step(kv: Array, g: Array, tok: Array, j: Array | int) -> tuple[Array, Array, Array]:
        pos = positions + j
        feats = head.midlayer.features(head.embed(target, tok), g)
        k, v = attn.kv(feats, pos)
        slots = slot_of(pos)
        kv = kernel.write(kv, k, v, slots)
        md = AttentionMetadata(slots, jnp.where(valid, pos + 1, 0), page_indices, cu_q_lens, num_seqs, kernel=kernel)
        o = paged_attention(attn.q(feats, pos), kv, md, sm_scale=attn.head_dim ** -0.5)
        x = head.midlayer.finish(g, o)
        return kv, x, head.logits(target, x)

    g0 = jnp.take(hidden.reshape(num_slots, width), slot_of(positions), axis=0, mode="clip")
    kv, x, logits = step(kv, g0, last_token_ids, 0)  # step 0 outside the scan: its confidence is kept
    first = head.greedy_target_ids(logits)
    top = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
    chain = DraftChain(x, first, jnp.where(valid, top, 0.0))
    drafts = [first[:, None]]

    def scan_step(carry: tuple[Array, Array, Array], j: Array) -> tuple[tuple[Array, Array, Array], Array]:
        kv, x, logits = step(*carry, j)
        nxt = head.greedy_target_ids(logits)
        return (kv, x, nxt), nxt

    if num_steps > 1:
        (kv, _, _), more = jax.lax.scan(scan_step, (kv, chain.g, chain.token_ids),
                                        jnp.arange(1, num_steps, dtype=jnp.int32))
        drafts.append(more.T)
    return kv, jnp.concatenate(drafts, axis=1), chain


def dense_steps(head: Eagle3Head, target: DraftTarget, g: Float[Array, "B S H"],
                next_token_ids: Int[Array, "B S"], positions: Int[Array, "B S"], num_steps: int
                ) -> list[Float[Array, "B S H"]]:
    """Training forward with EAGLE-3's training-time test: layer outputs of steps 0..num_steps-1.

    Step 0 at position p reads (g_p, token p + 1) and attends causally to step-0 keys (teacher
    forcing). Step j >= 1 at p reads the previous step's output at p - 1 with token p + 1, as the
    j-th drafting step does at inference: it attends to step-0 keys at positions <= p - j and to
    step i's key at p - j + i for i = 1..j. Step j's output at p predicts the token at p + 2.
    """
    layer, attn = head.midlayer, head.midlayer.self_attn
    embeds = head.embed(target, next_token_ids)
    scale = attn.head_dim ** -0.5
    group = attn.num_heads // attn.num_kv_heads
    batch, seq = next_token_ids.shape
    keys, values, outs = [], [], []
    x_prev = g
    for j in range(num_steps):
        hidden = g if j == 0 else jnp.pad(x_prev, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # output at p - 1
        feats = layer.features(embeds, hidden)
        q = attn.q(feats, positions).reshape(batch, seq, attn.num_kv_heads, group, attn.head_dim)
        k, v = attn.kv(feats, positions)
        keys.append(k)
        values.append(v)
        s0 = jnp.einsum("bqhgd,bkhd->bhgqk", q, keys[0], preferred_element_type=jnp.float32) * scale
        qi, ki = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
        s0 = jnp.where(ki <= qi - j, s0, MASK_VALUE)
        diag_scores, diag_values = [], []
        for i in range(1, j + 1):  # step i's key at p - j + i: shift it forward by j - i positions
            shift = j - i
            ks = jnp.pad(keys[i], ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :seq]
            vs = jnp.pad(values[i], ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :seq]
            sd = jnp.einsum("bqhgd,bqhd->bhgq", q, ks, preferred_element_type=jnp.float32) * scale
            diag_scores.append(jnp.where(jnp.arange(seq) >= shift, sd, MASK_VALUE)[..., None])
            diag_values.append(vs)
        scores = jnp.concatenate([s0, *diag_scores], axis=-1)
        probs = jax.nn.softmax(scores, axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", probs[..., :seq], values[0])
        for i, vs in enumerate(diag_values):
            o = o + jnp.einsum("bhgq,bqhd->bqhgd", probs[..., seq + i], vs)
        x = layer.finish(hidden, o.reshape(batch, seq, attn.num_heads, attn.head_dim).astype(g.dtype))
        outs.append(x)
        x_prev = x
    return outs


def vocab_maps(draft_to_target: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`d2t` offsets and the `t2d` coverage mask of a draft vocabulary given as target ids."""
    ids = np.asarray(draft_to_target, np.int64)
    if len(set(ids.tolist())) != len(ids) or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError("a draft vocabulary is distinct target ids inside the target's vocabulary")
    t2d = np.zeros(vocab_size, bool)
    t2d[ids] = True
    return ids - np.arange(len(ids)), t2d
