"""GRPO on the embedded SmolLM2-135M-Instruct with jax-rollout + Optax: two-digit arithmetic.

    python examples/grpo.py                  # default run (CPU: a few minutes per 10 steps)
    python examples/grpo.py --tiny --steps 2 # random 2-layer model: a plumbing smoke run

Each step:
  1. `engine.rollout` samples G completions for each of P fresh prompts ("What is 47 + 38?"), with
     the sampled tokens' logprobs (temperature 1, `logprobs_mode="raw"`: exactly the trainer's
     `log_softmax(logits)`; at another `--temperature` we ask for "processed" and the trainer divides
     its logits by the temperature);
  2. reward = 1.0 * correct + 0.1 * formatted + 0.5 * closeness (the last line is
     `Answer: <integer>`; closeness = max(0, 1 - |answer - truth| / 20); see `rl_common.py`); advantage = (r - mean of its group) / (std of its group + 1e-4);
  3. one Optax step on the clipped policy-gradient loss
        -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) (+ kl_coef * K3(pi || pi_init)),
     ratio = exp(logp_trainer - logp_engine), token-level mean over the batch. The trainer's logp
     comes from its own `LlamaForCausalLM` forward; that forward is computed BEFORE the update, so
     it also gives the sampler-vs-trainer mismatch (max / mean |diff|, K3 KL) logged every step;
  4. `engine.sync_weights(nnx.state(model, nnx.Param), version=step)`: the new weights go into the
     engine in place (no reload, no recompilation). The engine is built with `share_weights=True`: its
     parameters are the trainer's arrays (no second copy) and the sync swaps references.

To fit a 2-core CPU, only the last `--train-layers` decoder layers and the final norm are trained
(`nnx.split` into trainable / frozen states; `jax.value_and_grad` differentiates the trainable
state only, and the frozen trunk's output goes through `stop_gradient`, so the backward pass
touches the top layers alone). The logits (the costliest matmul, vocab 49152) are computed only at
the completion positions, never over the prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # `python examples/grpo.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
import optax
from flax import nnx

import rl_common as rl
from rollout import Engine, SamplingParams, load_tokenizer
from runner.models.loader import load_model

AdvantageFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def grpo_advantages(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """(r - group mean) / (group std + 1e-4): zero for a group whose samples all scored the same."""
    adv = np.zeros_like(rewards, dtype=np.float32)
    for g in np.unique(group_ids):
        r = rewards[group_ids == g]
        adv[group_ids == g] = (r - r.mean()) / (r.std() + 1e-4)
    return adv


@dataclasses.dataclass
class Config:
    model: str | None = None  # HF dir / .gguf; None = embedded SmolLM2-135M-Instruct
    tiny: bool = False  # random 2-layer model with the real tokenizer (smoke runs, tests)
    steps: int = 24
    prompts_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 24
    temperature: float = 1.0
    lr: float = 1e-4
    train_layers: int = 4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    seed: int = 0
    out_dir: str | None = "examples/results"  # None: write nothing
    name: str = "grpo"
    max_num_batched_tokens: int = 1024
    seq_len: int | None = None  # prompt + completion budget of the jitted loss (None: from the task's prompts)
    advantage_fn: AdvantageFn = grpo_advantages
    reward_fn: Callable[[str, rl.Problem], float] | None = None  # None: rl.score (tests swap it)


@dataclasses.dataclass
class StepLog:
    step: int
    reward: float
    accuracy: float
    format_rate: float
    completion_len: float
    loss: float
    grad_norm: float
    clip_frac: float
    kl_ref: float
    mismatch_max: float
    mismatch_mean: float
    mismatch_k3: float
    rollout_s: float
    train_s: float
    sync_s: float
    rollout_tok_s: float
    policy_version: int | None


class Trainer:
    """The model, its trainable / frozen split, the optimizer, and the engine."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        tokenizer = load_tokenizer(cfg.model)
        if cfg.tiny:
            self.model = rl.tiny_model(tokenizer.vocab_size, tokenizer.eos_token_ids, seed=cfg.seed)
        else:
            self.model, _ = load_model(cfg.model)  # the trainer's copy, which the engine shares (`share_weights`)
        self.tokenizer = tokenizer
        mcfg = self.model.config
        self.first = max(0, mcfg.num_hidden_layers - cfg.train_layers)  # first trained layer
        self.graphdef, self.trainable, self.frozen = nnx.split(
            self.model, rl.trainable_filter(mcfg.num_hidden_layers, cfg.train_layers), ...)
        self.ref = jax.tree.map(lambda x: x.copy(), self.trainable)  # the initial policy (for --kl-coef)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(cfg.lr, b1=0.9, b2=0.99))
        self.opt_state = self.tx.init(self.trainable)
        self.rng = np.random.default_rng(cfg.seed)
        # Fixed shapes for the jitted loss: prompt budget (longest prompt of a sample + slack) + max_tokens.
        probe = rl.make_problems(np.random.default_rng(12345), 64)
        longest = max(len(tokenizer.encode(rl.build_prompt(tokenizer, p))) for p in probe)
        self.seq_len = cfg.seq_len or -(-(longest + 2 + cfg.max_tokens) // 8) * 8
        self.engine = self.make_engine()
        self.engine.policy_version = 0
        loss = partial(rl.policy_loss, graphdef=self.graphdef, first=self.first, clip_eps=cfg.clip_eps,
                       kl_coef=cfg.kl_coef, temperature=cfg.temperature)
        tx = self.tx

        @jax.jit
        def train_step(trainable, opt_state, frozen, ref, batch):
            (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(trainable, frozen, ref, batch)
            updates, opt_state = tx.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, value, optax.global_norm(grads), aux

        self.train_step = train_step

    def make_engine(self, **config: object) -> Engine:
        cfg = self.cfg
        return Engine.from_model(self.model, self.tokenizer, max_num_seqs=max(64, cfg.prompts_per_step * cfg.group_size),
                                 max_model_len=self.seq_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                 seed=cfg.seed, share_weights=True, **config)

    def sampling_params(self, step: int, num_prompts: int) -> list[SamplingParams]:
        """One per prompt, each with its own seed: a request's noise is keyed by (seed, sample, position),
        so one seed shared by the step's prompts would give sample i of every group the same draws."""
        cfg = self.cfg
        return [SamplingParams(n=cfg.group_size, temperature=cfg.temperature, max_tokens=cfg.max_tokens, logprobs=0,
                               logprobs_mode="raw" if cfg.temperature == 1.0 else "processed",
                               seed=((cfg.seed * 1_000_003 + step) * 10_007 + j) % 2**32) for j in range(num_prompts)]

    def step(self, step: int) -> StepLog:
        cfg = self.cfg
        problems = rl.make_problems(self.rng, cfg.prompts_per_step)
        prompts = [rl.build_prompt(self.tokenizer, p) for p in problems]

        t0 = time.perf_counter()
        batch = self.engine.rollout(prompts, self.sampling_params(step, len(prompts)))
        rollout_s = time.perf_counter() - t0

        texts = [self.tokenizer.decode(ids[:n].tolist()) for ids, n in zip(batch.completion_ids, batch.completion_lens)]
        scored = [rl.score(t, problems[g].answer) for t, g in zip(texts, batch.group_ids)]
        if cfg.reward_fn is not None:
            rewards = np.array([cfg.reward_fn(t, problems[g]) for t, g in zip(texts, batch.group_ids)], np.float32)
        else:
            rewards = np.array([s[0] for s in scored], np.float32)
        adv = cfg.advantage_fn(rewards, batch.group_ids)
        seq_len = max(self.seq_len, -(-batch.input_ids.shape[1] // 8) * 8)
        packed = rl.pack(batch, adv, seq_len, cfg.max_tokens)

        t1 = time.perf_counter()
        self.trainable, self.opt_state, loss, gnorm, aux = self.train_step(
            self.trainable, self.opt_state, self.frozen, self.ref, packed)
        trainer_lp = np.asarray(aux["logprobs"])  # computed with the pre-update weights
        train_s = time.perf_counter() - t1

        t2 = time.perf_counter()
        nnx.update(self.model, self.trainable)
        self.engine.sync_weights(nnx.state(self.model, nnx.Param), version=step + 1)
        sync_s = time.perf_counter() - t2

        ntok = int(batch.completion_lens.sum())
        return StepLog(
            step=step, reward=float(rewards.mean()), accuracy=float(np.mean([s[1] for s in scored])),
            format_rate=float(np.mean([s[2] for s in scored])), completion_len=float(batch.completion_lens.mean()),
            loss=float(loss), grad_norm=float(gnorm), clip_frac=float(aux["clip_frac"]), kl_ref=float(aux["kl_ref"]),
            **rl.mismatch(packed["old_logprobs"], trainer_lp, packed["mask"]),
            rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, rollout_tok_s=ntok / max(rollout_s, 1e-9),
            policy_version=batch.policy_version)


def format_log(r: StepLog) -> str:
    return (f"step {r.step:3d}  reward {r.reward:.3f}  acc {r.accuracy:.3f}  fmt {r.format_rate:.2f}  "
            f"len {r.completion_len:5.1f}  loss {r.loss:+.4f}  |g| {r.grad_norm:.3f}  "
            f"mismatch max {r.mismatch_max:.2e} mean {r.mismatch_mean:.2e} k3 {r.mismatch_k3:+.1e}  "
            f"rollout {r.rollout_s:5.1f}s ({r.rollout_tok_s:4.0f} tok/s)  train {r.train_s:4.1f}s  sync {r.sync_s:.2f}s")


def run(cfg: Config, *, log: Callable[[str], None] = print, trainer_cls: type[Trainer] = Trainer,
        format_step: Callable[[StepLog], str] = format_log) -> list[StepLog]:
    """Train for `cfg.steps` steps; returns the per-step logs (and writes the plot / JSON / log)."""
    t_start = time.perf_counter()
    trainer = trainer_cls(cfg)
    setup_s = time.perf_counter() - t_start
    lines = [f"setup {setup_s:.1f}s  train layers [{trainer.first}, {trainer.model.config.num_hidden_layers}) "
             f"+ final norm  seq_len {trainer.seq_len}"]
    log(lines[-1])
    logs = []
    for step in range(cfg.steps):
        logs.append(trainer.step(step))
        lines.append(format_step(logs[-1]))
        log(lines[-1])
    total_s = time.perf_counter() - t_start
    rewards = [r.reward for r in logs]
    k = min(5, len(rewards))
    summary = dict(
        name=cfg.name, steps=cfg.steps, first5_reward=float(np.mean(rewards[:k])), last5_reward=float(np.mean(rewards[-k:])),
        first5_accuracy=float(np.mean([r.accuracy for r in logs[:k]])),
        last5_accuracy=float(np.mean([r.accuracy for r in logs[-k:]])),
        max_mismatch=max(r.mismatch_max for r in logs), mean_mismatch=float(np.mean([r.mismatch_mean for r in logs])),
        total_s=total_s, setup_s=setup_s, rollout_s=sum(r.rollout_s for r in logs),
        train_s=sum(r.train_s for r in logs), sync_s=sum(r.sync_s for r in logs),
        engine_compilations=trainer.engine.stats().num_compilations, num_weight_syncs=trainer.engine.stats().num_weight_syncs,
        config={k: v for k, v in dataclasses.asdict(cfg).items() if not callable(v)})
    lines.append(f"mean reward: first {k} steps {summary['first5_reward']:.3f}, last {k} steps "
                 f"{summary['last5_reward']:.3f}  (accuracy {summary['first5_accuracy']:.3f} -> "
                 f"{summary['last5_accuracy']:.3f})  total {total_s:.0f}s")
    log(lines[-1])
    if cfg.out_dir is not None:
        png = rl.write_results(cfg.out_dir, cfg.name, [dataclasses.asdict(r) for r in logs], summary)
        command = "python " + " ".join(sys.argv) if sys.argv and sys.argv[0].endswith(".py") else "run(Config(...))"
        (Path(cfg.out_dir) / f"{cfg.name}_log.txt").write_text("$ " + command + "\n" + "\n".join(lines) + "\n")
        log(f"wrote {png}, {cfg.name}.json, {cfg.name}_log.txt")
        log(json.dumps({k: v for k, v in summary.items() if k != "config"}))
    return logs


def parse_args(argv: list[str] | None = None, defaults: Config | None = None) -> Config:
    d = defaults or Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=d.model, help="HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="random 2-layer model (smoke run)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step (P)")
    p.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt (G)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--train-layers", type=int, default=d.train_layers, help="train the last N layers + final norm")
    p.add_argument("--clip-eps", type=float, default=d.clip_eps)
    p.add_argument("--kl-coef", type=float, default=d.kl_coef, help="K3 KL to the initial policy (0: off)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out-dir", default=d.out_dir)
    a = p.parse_args(argv)
    return dataclasses.replace(d, model=a.model, tiny=a.tiny, steps=a.steps, prompts_per_step=a.prompts,
                               group_size=a.group_size, max_tokens=a.max_tokens, temperature=a.temperature, lr=a.lr,
                               train_layers=a.train_layers, clip_eps=a.clip_eps, kl_coef=a.kl_coef, seed=a.seed,
                               out_dir=a.out_dir)


if __name__ == "__main__":
    run(parse_args())
