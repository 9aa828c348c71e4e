"""Asynchronous GRPO: rollouts run one policy version ahead of training, with in-flight weight updates.

    python examples/async_grpo.py                  # SmolLM2-135M-Instruct, two-digit arithmetic (examples/grpo.py's task)
    python examples/async_grpo.py --tiny --steps 2 # random 2-layer model: a plumbing smoke run

Step k trains on the batch sampled while step k - 1 trained: the rollout of step k + 1 starts (under
policy version k) before step k's update, and keeps running through `sync_weights(version=k + 1)`, which
lands between two engine steps (`AsyncEngine`): a sample's tokens may come from two versions, each token
recording its own (`policy_versions`). `max_policy_lag=1` bounds the staleness: a sample still running
when a sync would make it two versions old is recomputed under the new weights.

Sampling uses top-k (20 by default), so the engine's logprob of a token is the processed one (the
distribution it was drawn from), and each token carries its sampling record (`sampling_record=True`:
the kept log-mass and the kept ids). The importance ratio renormalises the trainer's policy over the
same kept set: `log pi_theta(t) - logsumexp(log pi_theta(kept)) - log mu(t)`, exactly 1.0 on-policy
(and the engine's logprob equals `log pi(t) - kept_logmass`). The clipped surrogate and the reward are
examples/grpo.py's. Results: examples/results/async_grpo.{png,json} and `async_grpo_log.txt`, with the
time per step next to the synchronous example's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # `python examples/async_grpo.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import grpo
import rl_common as rl
from rollout import AsyncEngine, Engine, SamplingParams
from rollout.rollout_batch import build_rollout_batch


@dataclasses.dataclass
class AsyncConfig(grpo.Config):
    name: str = "async_grpo"
    top_k: int = 20  # every sample is drawn from its 20 most likely tokens (its kept set)


def renormalised_loss(trainable: nnx.State, frozen: nnx.State, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
                      first: int, clip_eps: float, temperature: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy gradient with the ratio renormalised over each token's kept set (see the module doc)."""
    model = nnx.merge(graphdef, trainable, frozen)
    args = (batch["positions"], batch["attention_mask"])
    x = rl.trunk(model, first, batch["input_ids"], *args)
    for layer in model.layers[first:]:
        x = layer(x, *args)
    h = jnp.take_along_axis(model.norm(x), batch["gather_idx"][..., None], axis=1)  # [B, C, H]
    logp = jax.nn.log_softmax(model.compute_logits(h) / temperature, axis=-1)  # [B, C, V]
    lp = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    kept = batch["kept_ids"]  # [B, C, M], -1 past the set
    kept_lp = jnp.where(kept >= 0, jnp.take_along_axis(logp, jnp.maximum(kept, 0), axis=-1), -jnp.inf)
    target = lp - jax.nn.logsumexp(kept_lp, axis=-1)
    mask = batch["mask"]
    ntok = jnp.maximum(mask.sum(), 1.0)
    ratio = jnp.exp(jnp.where(mask > 0, target - batch["old_logprobs"], 0.0))
    adv = batch["advantages"][:, None]
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    clipped = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)
    return (per_token * mask).sum() / ntok, dict(logprobs=jax.lax.stop_gradient(target),
                                                  clip_frac=(clipped * mask).sum() / ntok, kl_ref=jnp.zeros(()))


class AsyncTrainer(grpo.Trainer):
    """examples/grpo.py's trainer with a top-k sampler, the sampling record and the renormalised loss."""

    def __init__(self, cfg: AsyncConfig) -> None:
        super().__init__(cfg)
        loss = partial(renormalised_loss, graphdef=self.graphdef, first=self.first, clip_eps=cfg.clip_eps,
                       temperature=cfg.temperature)
        tx = self.tx

        @jax.jit
        def train_step(trainable, opt_state, frozen, batch):
            (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(trainable, frozen, batch)
            updates, opt_state = tx.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, value, optax.global_norm(grads), aux

        self.renormalised_step = train_step

    def make_engine(self, **config: object) -> Engine:
        return super().make_engine(max_policy_lag=1, policy_lag_action="recompute", max_kept_ids=self.cfg.top_k, **config)

    def sampling_params(self, step: int, num_prompts: int) -> list[SamplingParams]:
        return [dataclasses.replace(sp, top_k=self.cfg.top_k, logprobs_mode="processed", sampling_record=True,
                                    max_kept_ids=self.cfg.top_k) for sp in super().sampling_params(step, num_prompts)]


async def rollout(trainer: AsyncTrainer, aengine: AsyncEngine, step: int) -> tuple[object, list[rl.Problem], float]:
    """Step `step`'s prompts, every sample a coroutine: (RolloutBatch, problems, seconds)."""
    t0 = time.perf_counter()
    problems = rl.make_problems(trainer.rng, trainer.cfg.prompts_per_step)
    prompts = [rl.build_prompt(trainer.tokenizer, p) for p in problems]
    outs = await asyncio.gather(*(aengine.generate(p, sp) for p, sp in
                                  zip(prompts, trainer.sampling_params(step, len(prompts)))))
    pad = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else 0
    return build_rollout_batch(list(outs), pad_id=pad, policy_version=None), problems, time.perf_counter() - t0


async def train(cfg: AsyncConfig, log=print) -> list[grpo.StepLog]:
    trainer = AsyncTrainer(cfg)
    aengine = AsyncEngine(trainer.engine)
    logs = []
    pending = asyncio.create_task(rollout(trainer, aengine, 0))
    for step in range(cfg.steps):
        t_step = time.perf_counter()
        batch, problems, rollout_s = await pending
        wait_s = time.perf_counter() - t_step  # how long training waited for its batch
        if step + 1 < cfg.steps:  # sampled under version `step` now, finished under `step + 1`
            pending = asyncio.create_task(rollout(trainer, aengine, step + 1))
        texts = [trainer.tokenizer.decode(ids[:n].tolist()) for ids, n in zip(batch.completion_ids, batch.completion_lens)]
        scored = [rl.score(t, problems[g].answer) for t, g in zip(texts, batch.group_ids)]
        rewards = np.array([s[0] for s in scored] if cfg.reward_fn is None else
                           [cfg.reward_fn(t, problems[g]) for t, g in zip(texts, batch.group_ids)], np.float32)
        seq_len = max(trainer.seq_len, -(-batch.input_ids.shape[1] // 8) * 8)
        packed = rl.pack(batch, cfg.advantage_fn(rewards, batch.group_ids), seq_len, cfg.max_tokens)
        kept = np.full((*packed["targets"].shape, cfg.top_k), -1, np.int32)
        c, m = batch.completion_kept_ids.shape[1:]
        kept[:, :c, :m] = np.where(batch.completion_kept_ids_valid[..., None], batch.completion_kept_ids, -1)
        packed["kept_ids"] = kept
        packed["mask"] = packed["mask"] * np.pad(batch.completion_kept_ids_valid, ((0, 0), (0, kept.shape[1] - c)))
        t1 = time.perf_counter()
        trainer.trainable, trainer.opt_state, loss, gnorm, aux = await asyncio.to_thread(
            trainer.renormalised_step, trainer.trainable, trainer.opt_state, trainer.frozen, packed)
        trainer_lp = np.asarray(aux["logprobs"])
        train_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        nnx.update(trainer.model, trainer.trainable)
        await aengine.sync_weights(nnx.state(trainer.model, nnx.Param), version=step + 1)
        sync_s = time.perf_counter() - t2
        versions = batch.completion_policy_versions[batch.completion_mask]
        ntok = int(batch.completion_lens.sum())
        logs.append(grpo.StepLog(
            step=step, reward=float(rewards.mean()), accuracy=float(np.mean([s[1] for s in scored])),
            format_rate=float(np.mean([s[2] for s in scored])), completion_len=float(batch.completion_lens.mean()),
            loss=float(loss), grad_norm=float(gnorm), clip_frac=float(aux["clip_frac"]), kl_ref=0.0,
            **rl.mismatch(packed["old_logprobs"], trainer_lp, packed["mask"]),
            rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, rollout_tok_s=ntok / max(rollout_s, 1e-9),
            policy_version=int(versions.max()) if versions.size else None))
        log(f"{grpo.format_log(logs[-1])}  waited {wait_s:4.1f}s  step {time.perf_counter() - t_step:5.1f}s  "
            f"versions {sorted(set(versions.tolist()))}")
    await aengine.close()
    return logs


def main(argv: list[str] | None = None) -> None:
    cfg = grpo.parse_args(argv, AsyncConfig())
    t0 = time.perf_counter()
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
    logs = asyncio.run(train(cfg, log=log))
    total = time.perf_counter() - t0
    k = min(5, len(logs))
    summary = dict(name=cfg.name, steps=cfg.steps, first5_reward=float(np.mean([r.reward for r in logs[:k]])),
                   last5_reward=float(np.mean([r.reward for r in logs[-k:]])), total_s=total,
                   seconds_per_step=total / len(logs), max_mismatch=max(r.mismatch_max for r in logs))
    log(json.dumps(summary))
    if cfg.out_dir is not None:
        rl.write_results(cfg.out_dir, cfg.name, [dataclasses.asdict(r) for r in logs], summary)
        command = "python " + " ".join(sys.argv)
        (Path(cfg.out_dir) / f"{cfg.name}_log.txt").write_text("$ " + command + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
