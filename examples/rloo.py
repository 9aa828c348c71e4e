"""RLOO (REINFORCE leave-one-out) on the same arithmetic task as `grpo.py`.

    python examples/rloo.py                  # embedded SmolLM2-135M-Instruct
    python examples/rloo.py --tiny --steps 2 # random 2-layer model: smoke run

The only difference from GRPO is the baseline: each of the G samples of a prompt is compared with
the mean reward of the OTHER G - 1 samples, and the advantage is not divided by a standard deviation:

    A_i = r_i - (sum_j r_j - r_i) / (G - 1)  =  G / (G - 1) * (r_i - mean_j r_j)

Everything else is `grpo.py`'s loop: `engine.rollout` (temperature 1, raw logprobs), the reward of
`rl_common.score`, one Optax step on the clipped policy-gradient loss (with one update per batch the
ratio is exactly 1 up to the sampler/trainer mismatch, i.e. plain REINFORCE with this baseline),
then `engine.sync_weights`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

import grpo


def rloo_advantages(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """r_i minus the mean reward of the other samples of its prompt (0 for a group of one)."""
    adv = np.zeros_like(rewards, dtype=np.float32)
    for g in np.unique(group_ids):
        r = rewards[group_ids == g]
        if len(r) > 1:
            adv[group_ids == g] = r - (r.sum() - r) / (len(r) - 1)
    return adv


DEFAULTS = dataclasses.replace(grpo.Config(), name="rloo", advantage_fn=rloo_advantages)


def parse_args(argv: list[str] | None = None) -> grpo.Config:
    return grpo.parse_args(argv, defaults=DEFAULTS)


if __name__ == "__main__":
    grpo.run(parse_args())
