"""Tunix's GRPO rollout step: this engine (`rollout.integrations.tunix.JaxRollout`) against Tunix's own
vanilla rollout, same model, prompts and lengths, in one run.

    python examples/bench_tunix.py                 # Tunix's default shapes (RolloutConfig, GrpoConfig)
    python examples/bench_tunix.py --prompts 8 --max-tokens 256 --max-prompt-length 256

The model is the embedded SmolLM2-135M-Instruct as a Tunix `Llama3` (examples/tunix_common.py). A
step is what `GrpoLearner` asks of its rollout: `generate` on `--prompts` problems of the arithmetic
task, each repeated `--generations` times (consecutive), with Tunix's `RolloutConfig` defaults:
max_tokens_to_generate 64, max_prompt_length 64, temperature 0.9, top_p 1.0, kv_cache_size 1024,
return_logprobs. Each side runs one untimed step first (compilation), then `--repeats` timed steps,
alternating. Also reported: mean and max |logprob - Tunix's recomputation| (Tunix's
`compute_per_token_logps(..., temperature)` on the Tunix model) over every completion token, for both.
Table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl import common
from tunix.rl.rollout import base_rollout, vanilla_rollout

import bench_common as bc
import rl_common
from rollout.integrations.tunix import JaxRollout
from tunix_common import smollm2_as_tunix


def logprob_gap(model: nnx.Module, out: base_rollout.RolloutOutput, pad: int, eos: int,
                temperature: float) -> tuple[float, float]:
    """Mean and max |rollout logprob - Tunix's recomputation| over every completion token."""
    width = max(1, max(len(t) for t in out.tokens))
    completions = np.full((len(out.tokens), width), pad, np.int32)
    for i, t in enumerate(out.tokens):
        completions[i, :len(t)] = t
    graphdef, state = nnx.split(model)
    want = np.asarray(common.compute_per_token_logps(graphdef, state, jnp.asarray(out.left_padded_prompt_tokens),
                                                     jnp.asarray(completions), pad, eos, temperature=temperature))
    gaps = np.concatenate([np.abs(np.asarray(lp) - want[i, :len(lp)]) for i, lp in enumerate(out.logprobs) if len(lp)])
    return float(gaps.mean()), float(gaps.max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="problems per step")
    p.add_argument("--generations", type=int, default=2, help="samples per problem (GrpoConfig.num_generations)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-length", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--kv-cache-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args()

    model, tokenizer = smollm2_as_tunix()
    adapter = TokenizerAdapter(tokenizer)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=args.max_tokens, max_prompt_length=args.max_prompt_length,
                                        temperature=args.temperature, top_p=1.0, kv_cache_size=args.kv_cache_size,
                                        return_logprobs=True)
    c = model.config
    vanilla = vanilla_rollout.VanillaRollout(model, adapter, base_rollout.CacheConfig(
        cache_size=args.kv_cache_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))
    ours = JaxRollout(model, adapter, None, config, max_num_seqs=max(8, args.prompts * args.generations))
    rng = np.random.default_rng(0)
    steps = [[rl_common.build_prompt(tokenizer.tokenizer, q) for q in rl_common.make_problems(rng, args.prompts)
              for _ in range(args.generations)] for _ in range(args.repeats + 1)]
    sides = {"jax-rollout": ours, "tunix vanilla": vanilla}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[int]] = {k: [] for k in sides}
    gaps: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for i, prompts in enumerate(steps):  # step 0 compiles (untimed); then alternate
        for name, side in sides.items():
            step_config = dataclasses.replace(config, seed=jax.random.PRNGKey(i)) if name == "tunix vanilla" else \
                dataclasses.replace(config, seed=i)
            t0 = time.perf_counter()
            out = side.generate(prompts, step_config)
            elapsed = time.perf_counter() - t0
            if i == 0:
                continue
            seconds[name].append(elapsed)
            tokens[name].append(sum(len(t) for t in out.tokens))
            gaps[name].append(logprob_gap(model, out, adapter.pad_id(), adapter.eos_id(), args.temperature))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    rows = [(name, f"{med[name]:.2f}", f"{np.mean(tokens[name]):.0f}", f"{np.mean(tokens[name]) / med[name]:.1f}",
             f"{np.mean([g[0] for g in gaps[name]]):.2e}", f"{max(g[1] for g in gaps[name]):.2e}") for name in sides]
    print(f"Tunix GRPO rollout step: {args.prompts} prompts x {args.generations} generations, {args.max_tokens} new "
          f"tokens, prompt length {args.max_prompt_length}, T={args.temperature}, {args.repeats} timed steps each")
    bc.print_table(("rollout", "s/step", "tokens/step", "tok/s", "mean |dlogp|", "max |dlogp|"), rows)
    ratio = med["tunix vanilla"] / med["jax-rollout"]
    print(f"jax-rollout is {ratio:.2f}x faster per step (target >= 3x)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    print(bc.json_line(dict(
        benchmark="tunix_rollout", commit=commit, prompts=args.prompts, generations=args.generations,
        max_tokens=args.max_tokens, seconds_per_step=med, ratio_to_vanilla=ratio,
        tokens_per_s={k: float(np.mean(tokens[k]) / med[k]) for k in sides},
        mean_abs_logprob_gap={k: float(np.mean([g[0] for g in gaps[k]])) for k in sides},
        max_abs_logprob_gap={k: float(max(g[1] for g in gaps[k])) for k in sides},
        compiled_programs=ours.engine.stats().num_compilations, peak_rss_bytes=bc.peak_rss_bytes()), args.out))


if __name__ == "__main__":
    main()
