"""Multi-turn tool-use RL (GRPO) with `AsyncEngine` on the embedded SmolLM2-135M-Instruct: a calculator.

    python examples/tool_use.py                   # default run: writes examples/results/tool_use.{png,json}
    python examples/tool_use.py --tiny --steps 2  # random 2-layer model: a plumbing smoke run

The task: "What is 23 * 47?" (two-digit products and three-digit sums). The prompt shows the protocol
once: the assistant may reply `CALC: <expression>`; the environment (a calculator) answers with a user
turn `Result: <value>`; the assistant then ends with `Answer: <number>`. Reward on the final answer
(`rl_common.score`: correct, formatted, closeness).

Every step runs P x G trajectories at once: each is a coroutine that awaits `AsyncEngine.generate` for
a turn, calls the tool, and goes on; finished turns free their slots while other trajectories still
decode (no batch barrier between turns). A trajectory is token in / token out (`rollout.Trajectory`):
the next turn's prompt is the previous prompt + completion + the environment's tokens exactly, so the
engine's prefix cache serves the history, and the environment's tokens are out of the loss
(`Engine.trajectory_batch`: `completion_mask` 0 there). The GRPO update is `grpo.py`'s: clipped policy
gradient over the policy's tokens of all turns, one Optax step, `sync_weights` in place.

The environment's turn is written in ChatML (`<|im_start|>user ... <|im_end|>`), the template of
SmolLM2 and Qwen; another model family needs its own `environment_ids`.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import operator
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python examples/tool_use.py` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from flax import nnx

import grpo
import rl_common as rl
from rollout import AsyncEngine, SamplingParams, Trajectory

SYSTEM = ("You are a careful assistant with a calculator. To compute, reply with one line: CALC: <expression>. "
          "The calculator replies with Result: <value>. Then reply with one line: Answer: <number>")
EXAMPLE = ({"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "CALC: 12 * 34"},
           {"role": "user", "content": "Result: 408"}, {"role": "assistant", "content": "Answer: 408"})
MAX_TURNS = 3
ENV_BUDGET = 24  # tokens of one environment turn (ChatML wrapper + "Result: <value>")
_CALC_LINE = re.compile(r"^\s*CALC:\s*([-+*/() 0-9.]+?)\s*$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def make_problems(rng: np.random.Generator, n: int) -> list[rl.Problem]:
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = (int(x) for x in rng.integers(11, 100, size=2))
            out.append(rl.Problem(f"What is {a} * {b}?", a * b))
        else:
            a, b = (int(x) for x in rng.integers(100, 1000, size=2))
            out.append(rl.Problem(f"What is {a} + {b}?", a + b))
    return out


def calculate(expression: str) -> str:
    """The tool: + - * / and parentheses over numbers, nothing else (no eval)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("unsupported expression")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(result)) if float(result).is_integer() else f"{result:.4g}"


def tool_call(text: str) -> str | None:
    """The expression of a `CALC:` line (the last non-empty line of a turn), or None."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    m = _CALC_LINE.match(lines[-1]) if lines else None
    return m.group(1) if m else None


class ToolTrainer(grpo.Trainer):
    """`grpo.Trainer` whose rollout is many concurrent multi-turn trajectories with a calculator."""

    def __init__(self, cfg: grpo.Config) -> None:
        super().__init__(cfg)
        tok = self.tokenizer
        self.end_id = tok.encode("<|im_end|>", add_special_tokens=False)
        self.completion_len = MAX_TURNS * cfg.max_tokens + (MAX_TURNS - 1) * (ENV_BUDGET + 1)

    def prompt_ids(self, problem: rl.Problem) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": problem.question}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    def environment_ids(self, completion_ids: list[int], result: str) -> list[int]:
        """The calculator's turn in ChatML; closes the assistant turn first if it was cut by max_tokens."""
        closing = [] if completion_ids[-1:] == self.end_id else self.end_id
        text = f"\n<|im_start|>user\nResult: {result}<|im_end|>\n<|im_start|>assistant\n"
        return (closing + self.tokenizer.encode(text, add_special_tokens=False))[:ENV_BUDGET + 1]

    async def trajectory(self, engine: AsyncEngine, problem: rl.Problem, seed: int) -> tuple[Trajectory, str, int]:
        """One conversation: (its trajectory, the last turn's text, tool calls made)."""
        cfg = self.cfg
        traj = Trajectory(self.prompt_ids(problem))
        calls = 0
        for turn in range(MAX_TURNS):
            sp = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, logprobs=0,
                                seed=(seed * 7 + turn) % 2**32)
            out = (await engine.generate(traj.token_ids, sp)).outputs[0]
            traj.add_completion(out)
            expression = tool_call(out.text)
            if expression is None or turn == MAX_TURNS - 1:
                return traj, out.text, calls
            calls += 1
            traj.add_environment(self.environment_ids(out.token_ids, calculate(expression)))
        raise AssertionError("unreachable")

    async def collect(self, problems: list[rl.Problem], step: int) -> list[tuple[Trajectory, str, int]]:
        engine = AsyncEngine(self.engine)
        g = self.cfg.group_size
        try:
            return await asyncio.gather(*(
                self.trajectory(engine, p, ((self.cfg.seed * 1_000_003 + step) * 10_007 + i * g + j))
                for i, p in enumerate(problems) for j in range(g)))
        finally:
            await engine.close()

    def step(self, step: int) -> "ToolStepLog":
        cfg = self.cfg
        problems = make_problems(self.rng, cfg.prompts_per_step)
        t0 = time.perf_counter()
        results = asyncio.run(self.collect(problems, step))
        rollout_s = time.perf_counter() - t0
        group_ids = [i for i in range(len(problems)) for _ in range(cfg.group_size)]
        batch = self.engine.trajectory_batch([t for t, _, _ in results], group_ids=group_ids)
        scored = [rl.score(text, problems[g].answer) for (_, text, _), g in zip(results, group_ids)]
        rewards = np.array([s[0] for s in scored], np.float32)
        adv = cfg.advantage_fn(rewards, batch.group_ids)
        seq_len = max(self.seq_len, -(-batch.input_ids.shape[1] // 8) * 8)
        packed = rl.pack(batch, adv, seq_len, self.completion_len)
        t1 = time.perf_counter()
        self.trainable, self.opt_state, loss, gnorm, aux = self.train_step(
            self.trainable, self.opt_state, self.frozen, self.ref, packed)
        trainer_lp = np.asarray(aux["logprobs"])
        train_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        nnx.update(self.model, self.trainable)
        self.engine.sync_weights(nnx.state(self.model, nnx.Param), version=step + 1)
        sync_s = time.perf_counter() - t2
        ntok = int(batch.completion_mask.sum())
        return ToolStepLog(
            step=step, reward=float(rewards.mean()), accuracy=float(np.mean([s[1] for s in scored])),
            format_rate=float(np.mean([s[2] for s in scored])), completion_len=ntok / len(results),
            loss=float(loss), grad_norm=float(gnorm), clip_frac=float(aux["clip_frac"]), kl_ref=float(aux["kl_ref"]),
            **rl.mismatch(packed["old_logprobs"], trainer_lp, packed["mask"]),
            rollout_s=rollout_s, train_s=train_s, sync_s=sync_s, rollout_tok_s=ntok / max(rollout_s, 1e-9),
            policy_version=batch.policy_version, tool_call_rate=float(np.mean([c > 0 for _, _, c in results])),
            turns=float(np.mean([t.num_turns for t, _, _ in results])))


@dataclasses.dataclass
class ToolStepLog(grpo.StepLog):
    tool_call_rate: float = 0.0  # fraction of trajectories that called the calculator
    turns: float = 0.0  # mean policy turns per trajectory


def format_step(r: ToolStepLog) -> str:
    return grpo.format_log(r) + f"  tool {r.tool_call_rate:.2f}  turns {r.turns:.2f}"


DEFAULTS = grpo.Config(name="tool_use", steps=20, prompts_per_step=4, group_size=8, max_tokens=16, lr=1e-4,
                       seq_len=240)

if __name__ == "__main__":
    grpo.run(grpo.parse_args(defaults=DEFAULTS), trainer_cls=ToolTrainer, format_step=format_step)
