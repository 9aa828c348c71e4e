"""Shared pieces of the RL examples (`grpo.py`, `rloo.py`): the arithmetic task and its verifiable
reward, the trainer's forward over a frozen trunk + trainable top layers, the clipped
policy-gradient loss, the sampler-vs-trainer mismatch figures, a tiny random model, and the plot.

The task: "What is 47 + 38?" (two-digit addition or subtraction, drawn from a seeded generator).
The prompt is a short system instruction, one worked example turn ("What is 25 + 17?" ->
"25 + 17 = 42\nAnswer: 42"), then the question; the model should end with the line `Answer: <number>`.
(Without the example turn SmolLM2-135M almost never uses the format: reward 0 everywhere, nothing to
learn from. With it, about 80% of its samples are formatted and ~15% correct at the start.)

The reward of one completion (in [0, 1.6]):

    reward = 1.0 * correct + 0.1 * formatted + 0.5 * closeness

- `formatted`: the last non-empty line of the completion is `Answer: <integer>` (nothing else on it);
- `correct`: that integer equals the true result (so a correct answer is always formatted too);
- `closeness`: partial credit for a formatted answer, max(0, 1 - |answer - truth| / 20) (1 when
  correct). Without it a group whose G answers are all wrong (frequent for a 135M model) has zero
  advantage everywhere and teaches nothing; with it "wrong by 2" beats "wrong by 200".
`accuracy` in the logs is the fraction of completions that are correct.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from runner.models.config import ModelConfig
from runner.models.llama import LlamaForCausalLM

# ---- the task -----------------------------------------------------------------------------------
SYSTEM_PROMPT = "You are a calculator. Reply with one line: Answer: <number>"
EXAMPLE_TURN = ({"role": "user", "content": "What is 25 + 17?"},
                {"role": "assistant", "content": "25 + 17 = 42\nAnswer: 42"})
FORMAT_REWARD = 0.1
CLOSENESS_REWARD = 0.5
CLOSENESS_SCALE = 20.0
_ANSWER_LINE = re.compile(r"^\s*Answer:\s*(-?\d+)\s*\.?\s*$")


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def make_problems(rng: np.random.Generator, n: int) -> list[Problem]:
    """`n` two-digit additions / subtractions (subtractions never go negative)."""
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(10, 100, size=2))
        if rng.random() < 0.5:
            out.append(Problem(f"What is {a} + {b}?", a + b))
        else:
            a, b = max(a, b), min(a, b)
            out.append(Problem(f"What is {a} - {b}?", a - b))
    return out


def build_prompt(tokenizer: Any, problem: Problem) -> str:
    """The chat-formatted prompt (system, the example turn, the question; generation prompt appended)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE_TURN,
                {"role": "user", "content": problem.question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def score(text: str, answer: int) -> tuple[float, bool, bool]:
    """(reward, correct, formatted) of one completion; see the module docstring."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    m = _ANSWER_LINE.match(lines[-1]) if lines else None
    formatted = m is not None
    correct = formatted and int(m.group(1)) == answer
    closeness = max(0.0, 1.0 - abs(int(m.group(1)) - answer) / CLOSENESS_SCALE) if formatted else 0.0
    return float(correct) + FORMAT_REWARD * float(formatted) + CLOSENESS_REWARD * closeness, correct, formatted


# ---- the trainer's forward: frozen trunk, trainable top -----------------------------------------
def trainable_filter(num_layers: int, train_layers: int) -> Callable[[tuple, Any], bool]:
    """Params of the last `train_layers` decoder layers and the final norm (the embedding, tied to
    the output projection in SmolLM2, stays frozen)."""
    first = max(0, num_layers - train_layers)

    def is_trainable(path: tuple, _value: Any) -> bool:
        return path[0] == "norm" or (path[0] == "layers" and int(path[1]) >= first)

    return nnx.All(nnx.Param, is_trainable)


def trunk(model: LlamaForCausalLM, first: int, input_ids: jax.Array, positions: jax.Array,
          attention_mask: jax.Array) -> jax.Array:
    """Hidden states after the frozen layers `[0, first)`; no gradient flows into them."""
    x = model.embed(input_ids)
    for layer in model.layers[:first]:
        x = layer(x, positions, attention_mask)
    return jax.lax.stop_gradient(x)


def top_logprobs(model: LlamaForCausalLM, first: int, x: jax.Array, positions: jax.Array,
                 attention_mask: jax.Array, gather_idx: jax.Array, targets: jax.Array,
                 temperature: float) -> jax.Array:
    """Layers `[first, L)`, the final norm, then log p(target) at the gathered positions only.

    `gather_idx[b, j]` is the position whose logits predict completion token `targets[b, j]`
    (`prompt_len - 1 + j`), so the `[B, C, V]` logits cover the completions, not the prompts.
    """
    for layer in model.layers[first:]:
        x = layer(x, positions, attention_mask)
    h = jnp.take_along_axis(model.norm(x), gather_idx[..., None], axis=1)  # [B, C, H]
    logits = model.compute_logits(h)
    if temperature != 1.0:
        logits = logits / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def pack(batch: Any, advantages: np.ndarray, seq_len: int, completion_len: int) -> dict[str, np.ndarray]:
    """The `RolloutBatch` arrays the loss needs, padded to fixed shapes (one compiled program).

    Uses the batch's completion-aligned fields: token `completion_ids[b, j]` sits at
    `input_ids[b, prompt_lens[b] + j]` and is predicted by the logits at `prompt_lens[b] - 1 + j`,
    i.e. `loss_mask[b, prompt_lens[b] - 1 + j] == 1` (checked in tests/test_examples.py).
    """
    b, t = batch.input_ids.shape
    c = batch.completion_ids.shape[1]
    if t > seq_len or c > completion_len:
        raise ValueError(f"batch of length {t} / completions {c} exceeds the padded shape {seq_len} / {completion_len}")
    input_ids = np.full((b, seq_len), batch.pad_id, np.int32)
    input_ids[:, :t] = batch.input_ids
    attention_mask = np.zeros((b, seq_len), np.int32)
    attention_mask[:, :t] = batch.attention_mask
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (b, seq_len)).copy()
    mask = np.zeros((b, completion_len), np.float32)
    mask[:, :c] = batch.completion_mask
    targets = np.full((b, completion_len), batch.pad_id, np.int32)
    targets[:, :c] = batch.completion_ids
    old_logprobs = np.zeros((b, completion_len), np.float32)
    old_logprobs[:, :c] = batch.completion_logprobs
    gather_idx = np.minimum(batch.prompt_lens[:, None] - 1 + np.arange(completion_len)[None, :], seq_len - 1)
    return dict(input_ids=input_ids, positions=positions, attention_mask=attention_mask,
                gather_idx=gather_idx.astype(np.int32), targets=targets, mask=mask, old_logprobs=old_logprobs,
                advantages=advantages.astype(np.float32))


# ---- the loss -------------------------------------------------------------------------------------
def policy_loss(trainable: nnx.State, frozen: nnx.State, ref_trainable: nnx.State, batch: dict[str, jax.Array], *,
                graphdef: nnx.GraphDef, first: int, clip_eps: float, kl_coef: float, temperature: float
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy gradient (PPO ratio against the engine's logprobs) + optional K3 KL to the
    initial policy, averaged over every completion token of the batch (token-level mean)."""
    model = nnx.merge(graphdef, trainable, frozen)
    args = (batch["positions"], batch["attention_mask"])
    x = trunk(model, first, batch["input_ids"], *args)
    lp = top_logprobs(model, first, x, *args, batch["gather_idx"], batch["targets"], temperature)
    mask = batch["mask"]
    ntok = jnp.maximum(mask.sum(), 1.0)
    ratio = jnp.exp(lp - batch["old_logprobs"])
    adv = batch["advantages"][:, None]
    pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    per_token = pg
    kl_ref = jnp.zeros(())
    if kl_coef:
        ref = nnx.merge(graphdef, ref_trainable, frozen)
        ref_lp = jax.lax.stop_gradient(top_logprobs(ref, first, x, *args, batch["gather_idx"], batch["targets"],
                                                    temperature))
        k3 = jnp.exp(ref_lp - lp) - (ref_lp - lp) - 1.0  # K3 estimate of KL(pi || pi_ref)
        per_token = per_token + kl_coef * k3
        kl_ref = (k3 * mask).sum() / ntok
    loss = (per_token * mask).sum() / ntok
    clipped = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)
    return loss, dict(logprobs=jax.lax.stop_gradient(lp), kl_ref=kl_ref, clip_frac=(clipped * mask).sum() / ntok)


def mismatch(engine_lp: np.ndarray, trainer_lp: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Sampler vs trainer logprobs on the sampled tokens: max / mean |diff| and the K3 estimate of
    KL(sampler || trainer) = E_sampler[r - 1 - log r], r = p_trainer / p_sampler."""
    m = mask.astype(bool)
    if not m.any():
        return dict(mismatch_max=0.0, mismatch_mean=0.0, mismatch_k3=0.0)
    d = (trainer_lp - engine_lp)[m].astype(np.float64)
    return dict(mismatch_max=float(np.abs(d).max()), mismatch_mean=float(np.abs(d).mean()),
                mismatch_k3=float(np.mean(np.expm1(d) - d)))


# ---- a tiny random model (smoke runs and tests) ---------------------------------------------------
def tiny_model(vocab_size: int, eos_token_ids: tuple[int, ...], seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer random Llama with the real tokenizer's vocabulary (tied embeddings, like SmolLM2)."""
    cfg = ModelConfig(family="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_ids=tuple(eos_token_ids))
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))


# ---- outputs ---------------------------------------------------------------------------------------
def write_results(out_dir: str | Path, name: str, logs: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
    """`<name>.png` (reward / accuracy and mismatch per step) and `<name>.json` (one line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in logs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["reward"] for r in logs], marker="o", label="mean reward")
    ax1.plot(steps, [r["accuracy"] for r in logs], marker=".", label="accuracy")
    ax1.set_xlabel("step")
    ax1.set_title(f"{name}: reward")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.semilogy(steps, [max(r["mismatch_max"], 1e-12) for r in logs], marker="o", label="max |lp_engine - lp_trainer|")
    ax2.semilogy(steps, [max(r["mismatch_mean"], 1e-12) for r in logs], marker=".", label="mean |diff|")
    ax2.semilogy(steps, [max(abs(r["mismatch_k3"]), 1e-12) for r in logs], marker="x", label="|K3 KL|")
    ax2.set_xlabel("step")
    ax2.set_title("sampler vs trainer logprobs (before update)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    png = out / f"{name}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    (out / f"{name}.json").write_text(json.dumps(summary) + "\n")
    return png
