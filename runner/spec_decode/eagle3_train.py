"""Training an EAGLE-3 head on the target's own outputs: features, labels and the loss.

Labels are the target's greedy next token at every position (what exact verification accepts under
greedy decoding). Head position p reads g_p and token p + 1 and is trained to predict the target's
token after p + 1 (`labels[p + 1]`), at every training-time-test step (`dense_steps`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from runner.models.family import DraftTarget
from runner.spec_decode.eagle3 import Eagle3Head, dense_steps


def pack_sequences(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids `[B, S]` (zero-padded to the longest) and the float mask of real tokens."""
    length = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], mask[i, :len(s)] = s, 1.0
    return tokens, mask


def target_features(target: DraftTarget, token_ids: Int[Array, "B S"], aux_layers: tuple[int, ...],
                    attention_mask: Int[Array, "B S"] | None = None
                    ) -> tuple[Float[Array, "B S A"], Int[Array, "B S"], Float[Array, "B S H"]]:
    """The target's aux hidden states, greedy next-token labels and final (normed) hidden states."""
    positions = jnp.broadcast_to(jnp.arange(token_ids.shape[1]), token_ids.shape)
    hidden, aux = target.hidden_states_with_aux(token_ids, positions, attention_mask, aux_layers)
    return aux, jnp.argmax(target.compute_logits(hidden), axis=-1).astype(jnp.int32), hidden


def _draft_rows_of_target_output(target: DraftTarget, head: Eagle3Head) -> Float[Array, "Vd H"]:
    ids = head.d2t[...] + jnp.arange(head.config.draft_vocab_size, dtype=jnp.int32)
    return jnp.take(target.output_rows(), ids, axis=0)


def target_to_draft(head: Eagle3Head) -> np.ndarray:
    """`[vocab]` draft id of every target id, -1 where the draft vocabulary lacks it."""
    d2t = np.asarray(head.d2t[...], np.int64)
    out = np.full(head.config.vocab_size, -1, np.int32)
    out[d2t + np.arange(len(d2t))] = np.arange(len(d2t), dtype=np.int32)
    return out


def eagle3_loss(head: Eagle3Head, target: DraftTarget, aux: Float[Array, "B S A"], token_ids: Int[Array, "B S"],
                labels: Int[Array, "B S"], mask: Float[Array, "B S"], t2d: Int[Array, "V"], num_steps: int,
                target_hidden: Float[Array, "B S H"] | None = None, train_lm_head: bool = True
                ) -> tuple[Float[Array, ""], Float[Array, "K"]]:
    """Mean cross-entropy over `num_steps` training-time-test steps, and each step's top-1 accuracy.

    `mask[b, p]` = 1 where token p is real; a position counts when tokens p + 1 exist and the label is
    in the draft vocabulary. With `target_hidden` the targets are soft: the target's distribution
    over the draft vocabulary (as SpecForge trains EAGLE-3), else its greedy label.
    `train_lm_head=False` keeps the head's lm_head fixed (no gradient reaches it).
    """
    batch, seq = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(seq), token_ids.shape)
    next_ids = jnp.pad(token_ids[:, 1:], ((0, 0), (0, 1)))
    next_labels = jnp.pad(labels[:, 1:], ((0, 0), (0, 1)))
    next_mask = jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
    draft_labels = t2d[next_labels]
    outs = dense_steps(head, target, head.fc(aux), next_ids, positions, num_steps)
    soft = None
    if target_hidden is not None:
        next_hidden = jnp.pad(target_hidden[:, 1:], ((0, 0), (0, 1), (0, 0)))
        rows = _draft_rows_of_target_output(target, head).astype(next_hidden.dtype)
        soft = jax.nn.softmax(jnp.einsum("bsh,vh->bsv", next_hidden, rows).astype(jnp.float32), axis=-1)
    losses, accs = [], []
    for j, x in enumerate(outs):
        if train_lm_head or head.lm_head is None:
            logits = head.logits(target, x)
        else:
            logits = (head.norm(x) @ jax.lax.stop_gradient(head.lm_head.kernel[...])).astype(jnp.float32)
        valid = (mask * next_mask * (draft_labels >= 0) * (positions >= j)).astype(jnp.float32)
        lab = jnp.maximum(draft_labels, 0)
        if soft is None:
            ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
        else:
            ce = -jnp.sum(soft * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        n = jnp.maximum(valid.sum(), 1.0)
        losses.append((ce * valid).sum() / n)
        accs.append(((jnp.argmax(logits, axis=-1) == lab) * valid).sum() / n)
    return jnp.mean(jnp.stack(losses)), jnp.stack(accs)
