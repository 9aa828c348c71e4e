"""Tunix's GRPO (`GrpoLearner`) on the embedded SmolLM2-135M-Instruct, with jax-rollout as its rollout engine.

    pip install -e ".[tunix]"
    python examples/tunix_grpo.py                    # writes examples/results/tunix_grpo.{json,txt}
    python examples/tunix_grpo.py --engine vanilla   # the same run on Tunix's own rollout, for comparison

The one line that differs from a stock Tunix setup is `rollout_engine=JaxRollout` in `ClusterConfig`.
The model is SmolLM2 as a Tunix `Llama3` (examples/tunix_common.py): Tunix trains it (actor and a
frozen reference), the engine samples, and after every step Tunix's `sync_weights` calls
`JaxRollout.update_params`, which syncs the new weights in place. The task and reward are those of
`examples/grpo.py` (two-digit arithmetic, `rl_common.score`). Logged per step: mean reward, accuracy,
rollout seconds, step seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from tunix.rl import rl_cluster as rlc
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

import rl_common
from rollout.integrations.tunix import JaxRollout
from tunix_common import smollm2_as_tunix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompts", type=int, default=4, help="problems per step")
    p.add_argument("--generations", type=int, default=4, help="GrpoConfig.num_generations")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--engine", choices=("jax-rollout", "vanilla"), default="jax-rollout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()

    start = time.perf_counter()
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    actor, tokenizer = smollm2_as_tunix(mesh)
    reference, _ = smollm2_as_tunix(mesh)
    rollout_config = base_rollout.RolloutConfig(max_tokens_to_generate=args.max_tokens, max_prompt_length=128,
                                                temperature=1.0, top_p=1.0, kv_cache_size=256, return_logprobs=True)
    training = rlc.RLTrainingConfig(actor_optimizer=optax.adam(args.lr), eval_every_n_steps=10**6,
                                    max_steps=args.steps, mini_batch_size=args.prompts,
                                    train_micro_batch_size=args.prompts)
    cluster = rlc.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=rlc.ClusterConfig(
        role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
        rollout_engine=JaxRollout if args.engine == "jax-rollout" else "vanilla", offload_to_cpu=False,
        training_config=training, rollout_config=rollout_config))

    logs: list[dict[str, float]] = []
    rollout_seconds: list[float] = []
    generate = cluster.rollout.generate

    def timed_generate(prompts: list[str], config: base_rollout.RolloutConfig, **kw: object
                       ) -> base_rollout.RolloutOutput:
        t0 = time.perf_counter()
        out = generate(prompts, config, **kw)
        rollout_seconds.append(time.perf_counter() - t0)
        return out

    cluster.rollout.generate = timed_generate

    def reward(prompts: list[str], completions: list[str], answer: list[int], **kw: object) -> list[float]:
        scored = [rl_common.score(c, int(a)) for c, a in zip(completions, answer)]
        logs.append(dict(step=len(logs), reward=float(np.mean([s[0] for s in scored])),
                         accuracy=float(np.mean([s[1] for s in scored])), formatted=float(np.mean([s[2] for s in scored])),
                         rollout_seconds=rollout_seconds[-1], elapsed=time.perf_counter() - start))
        print(json.dumps(logs[-1]), flush=True)
        return [s[0] for s in scored]

    rng = np.random.default_rng(args.seed)
    data = []
    for _ in range(args.steps):
        problems = rl_common.make_problems(rng, args.prompts)
        data.append({"prompts": np.array([rl_common.build_prompt(tokenizer.tokenizer, q) for q in problems]),
                     "answer": np.array([q.answer for q in problems])})
    learner = grpo_learner.GrpoLearner(rl_cluster=cluster, reward_fns=[reward], algo_config=grpo_learner.GrpoConfig(
        num_generations=args.generations, beta=args.beta))
    learner.train(data)

    first, last = logs[:3], logs[-3:]
    summary = dict(engine=args.engine, steps=len(logs), prompts=args.prompts, generations=args.generations,
                   max_tokens=args.max_tokens, lr=args.lr, beta=args.beta, seed=args.seed,
                   reward_first3=float(np.mean([r["reward"] for r in first])),
                   reward_last3=float(np.mean([r["reward"] for r in last])),
                   accuracy_first3=float(np.mean([r["accuracy"] for r in first])),
                   accuracy_last3=float(np.mean([r["accuracy"] for r in last])),
                   rollout_seconds_per_step=float(np.median(rollout_seconds[1:] or rollout_seconds)),
                   seconds=time.perf_counter() - start, command=" ".join(sys.argv))
    print(json.dumps(summary))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "tunix_grpo" if args.engine == "jax-rollout" else "tunix_grpo_vanilla"
    (out / f"{name}.json").write_text(json.dumps(dict(summary=summary, steps=logs), indent=1) + "\n")


if __name__ == "__main__":
    main()
