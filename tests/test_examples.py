"""The examples' plumbing on a tiny random model: two GRPO steps through engine.rollout ->
reward -> loss/update -> sync_weights, the task's reward, the advantage estimators and a benchmark helper."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import grpo  # noqa: E402
import rl_common as rl  # noqa: E402
import rloo  # noqa: E402


def test_score() -> None:
    assert rl.score("Answer: 85", 85) == (1.0 + rl.FORMAT_REWARD + rl.CLOSENESS_REWARD, True, True)
    assert rl.score("37 + 48 = 85\nAnswer: 85\n", 85)[1]
    assert rl.score("Answer: 84", 85) == (rl.FORMAT_REWARD + rl.CLOSENESS_REWARD * 0.95, False, True)
    assert rl.score("Answer: 185", 85) == (rl.FORMAT_REWARD, False, True)
    assert rl.score("The answer is 85", 85) == (0.0, False, False)
    assert rl.score("Answer: 85 because", 85) == (0.0, False, False)
    assert rl.score("", 85) == (0.0, False, False)
    assert rl.score("Answer: -3", -3)[1]


def test_advantages() -> None:
    r = np.array([1.0, 0.0, 0.0, 0.0, 0.5, 0.5], np.float32)
    g = np.array([0, 0, 0, 0, 1, 1])
    a = grpo.grpo_advantages(r, g)
    np.testing.assert_allclose(a[:4].mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(a[:4].std(), 1.0, atol=1e-3)
    np.testing.assert_array_equal(a[4:], 0.0)
    b = rloo.rloo_advantages(r, g)
    np.testing.assert_allclose(b[:4], [1.0, -1 / 3, -1 / 3, -1 / 3], atol=1e-6)  # r_i - mean of the others
    np.testing.assert_array_equal(b[4:], 0.0)


def _greedy_logprobs(engine, prompt: str) -> np.ndarray:
    from rollout import SamplingParams

    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))[0].outputs[0]
    return np.array([t.logprob for t in out.logprobs])


def _check_pack_alignment(trainer: grpo.Trainer) -> None:
    """`pack`'s gathered positions / targets agree with the RolloutBatch's loss_mask alignment."""
    problems = rl.make_problems(np.random.default_rng(0), 3)
    batch = trainer.engine.rollout([rl.build_prompt(trainer.tokenizer, p) for p in problems],
                                   trainer.sampling_params(0, len(problems)))
    assert len({sp.seed for sp in trainer.sampling_params(0, 3)}) == 3  # each prompt its own noise
    c = trainer.cfg.max_tokens
    p = rl.pack(batch, np.zeros(len(batch.group_ids)), trainer.seq_len, c)
    for b in range(len(batch.group_ids)):
        for j in range(c):
            t = p["gather_idx"][b, j]
            if p["mask"][b, j]:
                assert batch.loss_mask[b, t] == 1.0
                assert batch.input_ids[b, t + 1] == p["targets"][b, j]
                assert batch.logprobs[b, t] == p["old_logprobs"][b, j]
    assert p["mask"].sum() == batch.loss_mask.sum()


def test_grpo_two_steps_tiny() -> None:
    # A random model never writes "Answer: N", so every task reward would be 0 and every advantage 0;
    # a text-hash reward gives the groups spread, so the update is not trivially zero.
    cfg = grpo.Config(tiny=True, steps=2, prompts_per_step=2, group_size=4, max_tokens=8, lr=1e-2,
                      train_layers=1, out_dir=None, reward_fn=lambda text, _p: float(sum(map(ord, text)) % 7))
    trainer = grpo.Trainer(cfg)
    probe = rl.build_prompt(trainer.tokenizer, rl.Problem("What is 12 + 30?", 42))
    _check_pack_alignment(trainer)
    engine_before = _greedy_logprobs(trainer.engine, probe)
    params_before = jax.tree.map(np.array, trainer.trainable)
    frozen_before = jax.tree.map(np.array, trainer.frozen)

    logs = [trainer.step(0), trainer.step(1)]

    for log in logs:
        assert np.isfinite(log.reward) and log.reward > 0  # rewards computed
        assert np.isfinite(log.loss) and np.isfinite(log.grad_norm) and log.grad_norm > 0
        assert log.completion_len > 0 and log.rollout_tok_s > 0
        # sampler vs trainer (float32): on step 1 the engine serves the weights synced after step 0
        assert log.mismatch_max < 1e-5, log
    assert [log.policy_version for log in logs] == [0, 1]
    assert trainer.engine.policy_version == 2 and trainer.engine.stats().num_weight_syncs == 2

    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)),
                                           params_before, trainer.trainable))
    assert all(changed), "every trainable parameter should move"
    same = jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), frozen_before, trainer.frozen))
    assert all(same), "frozen parameters must not move"

    engine_after = _greedy_logprobs(trainer.engine, probe)
    assert np.abs(engine_after - engine_before).max() > 1e-4, "engine outputs should change after sync_weights"


@pytest.mark.parametrize("script", ["grpo", "rloo"])
def test_cli_parses(script: str) -> None:
    module = {"grpo": grpo, "rloo": rloo}[script]
    cfg = module.parse_args(["--tiny", "--steps", "1", "--train-layers", "1"])
    assert cfg.tiny and cfg.steps == 1 and cfg.train_layers == 1


def test_bench_spec_first_difference() -> None:
    import bench_spec

    assert bench_spec.first_difference([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == (1, 1)
    assert bench_spec.first_difference([[1, 2]], [[1, 2]]) is None
    assert bench_spec.first_difference([[1, 2]], [[1]]) == (0, 1)  # one run stopped earlier


def test_every_public_name_is_documented() -> None:
    """docs/api.md has a section for every name `rollout` exports."""
    import rollout

    api = Path(__file__).resolve().parent.parent / "docs" / "api.md"
    headings = {line[3:].strip() for line in api.read_text().splitlines()
                if line.startswith("## ")}
    assert set(rollout.__all__) <= headings, sorted(set(rollout.__all__) - headings)
