"""The examples' plumbing on a tiny random model: two GRPO steps through engine.rollout ->
reward -> loss/update -> sync_weights, the task's reward, the advantage estimators and a benchmark helper."""

from __future__ import annotations

import dataclasses
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


def test_async_grpo_three_steps_tiny() -> None:
    """Rollouts one version ahead: every token's version is recorded and at most one behind the trainer;
    the renormalised ratio against the engine's processed logprob is 1 on the tokens sampled by the
    weights being trained (float32), and the parameters move."""
    import asyncio

    import async_grpo

    cfg = async_grpo.AsyncConfig(tiny=True, steps=3, prompts_per_step=2, group_size=4, max_tokens=8, lr=1e-2,
                                 train_layers=1, out_dir=None, top_k=5,
                                 reward_fn=lambda text, _p: float(sum(map(ord, text)) % 7))
    cfg = dataclasses.replace(cfg, advantage_fn=lambda r, g: (r - r.mean()).astype(np.float32))
    logs = asyncio.run(async_grpo.train(cfg, log=lambda _line: None))
    assert len(logs) == 3 and all(np.isfinite(x.loss) and x.grad_norm > 0 for x in logs)
    assert logs[0].mismatch_max < 1e-5  # step 0: sampled and trained under version 0
    assert [x.policy_version for x in logs][0] == 0 and all(x.policy_version <= x.step for x in logs)


def test_calculator_tool() -> None:
    import tool_use

    assert tool_use.calculate("12 * 34") == "408" and tool_use.calculate("(3 + 4) / 2") == "3.5"
    assert tool_use.calculate("__import__('os')") == "error" and tool_use.calculate("1 / 0") == "error"
    assert tool_use.tool_call("Let me see.\nCALC: 23 * 47\n") == "23 * 47"
    assert tool_use.tool_call("Answer: 12") is None


def test_tool_use_trajectories_mask_the_calculator() -> None:
    """The tool-use loop on a scripted policy (a CALC turn, then the answer): the calculator's ChatML
    turn is appended as environment tokens, out of the loss; the packed batch lines up with `pack`."""
    import asyncio

    import tool_use
    from rollout import CompletionOutput, RequestOutput, TokenLogprob

    cfg = grpo.Config(tiny=True, steps=1, prompts_per_step=1, group_size=2, max_tokens=16, train_layers=1,
                      out_dir=None, seq_len=240)
    trainer = tool_use.ToolTrainer(cfg)
    tok = trainer.tokenizer
    replies = iter(["CALC: 12 * 34", "Answer: 408"] * 2)

    class ScriptedEngine:
        async def generate(self, prompt_ids: list[int], sp) -> RequestOutput:
            ids = tok.encode(next(replies), add_special_tokens=False) + trainer.end_id
            c = CompletionOutput(0, ids, tok.decode(ids), [TokenLogprob(t, -0.5, {}) for t in ids], -0.5 * len(ids),
                                 "stop", None, 3, [3] * len(ids))
            return RequestOutput("r", None, prompt_ids, None, [c])

    problem = rl.Problem("What is 12 * 34?", 408)
    traj, text, calls = asyncio.run(trainer.trajectory(ScriptedEngine(), problem, seed=0))
    assert calls == 1 and traj.num_turns == 2 and rl.score(text, 408)[1]
    env = tok.decode([t for t, m in zip(traj.completion_ids, traj.sampled_mask) if not m], skip_special_tokens=False)
    assert env == "\n<|im_start|>user\nResult: 408<|im_end|>\n<|im_start|>assistant\n"
    batch = trainer.engine.trajectory_batch([traj, traj], group_ids=[0, 0])
    packed = rl.pack(batch, np.ones(2), trainer.seq_len, trainer.completion_len)
    assert packed["mask"][0].sum() == sum(traj.sampled_mask) and packed["mask"].sum() == batch.loss_mask.sum()
    np.testing.assert_array_equal(packed["old_logprobs"][0][packed["mask"][0] > 0], -0.5)
    assert (batch.completion_policy_versions[0][:len(traj.completion_ids)] == np.where(traj.sampled_mask, 3, -1)).all()


def test_tool_use_step_tiny() -> None:
    import tool_use

    cfg = grpo.Config(tiny=True, steps=1, prompts_per_step=2, group_size=2, max_tokens=8, train_layers=1,
                      out_dir=None, seq_len=240)
    trainer = tool_use.ToolTrainer(cfg)
    log = trainer.step(0)
    assert np.isfinite(log.loss) and log.turns >= 1 and log.completion_len > 0 and log.mismatch_max < 1e-5
    assert trainer.engine.policy_version == 1 and not trainer.engine.core.requests


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
    """docs/api/ has a page for every name `rollout` exports, and the pages of the dataclasses users
    fill or read name every one of their fields."""
    import dataclasses

    import rollout

    api = Path(__file__).resolve().parent.parent / "docs" / "api"
    missing = [name for name in rollout.__all__ if not (api / f"{name}.md").is_file()]
    assert not missing, f"no docs/api/<name>.md for {missing}"
    index = (api / "README.md").read_text()
    assert all(f"({name}.md)" in index for name in rollout.__all__)
    for name in ("SamplingParams", "EngineConfig", "CompletionOutput", "RolloutBatch", "RequestOutput"):
        page = (api / f"{name}.md").read_text()
        undocumented = [f.name for f in dataclasses.fields(getattr(rollout, name)) if f"`{f.name}`" not in page]
        assert not undocumented, f"docs/api/{name}.md does not describe {undocumented}"
    page = (api / "TokenLogprob.md").read_text()
    assert all(f"`{field}`" in page for field in rollout.TokenLogprob._fields)