"""Colocated with a trainer: what the engine's weights cost, shared (`share_weights=True`) vs its own copy.

Each row is one process (the peak RSS is a process's): the trainer loads the model, the engine is built
from it (`Engine.from_model`), then one GRPO step runs (a rollout of P prompts x G samples, an Optax Adam
step on the last `--train-layers` layers and the final norm, `sync_weights` of the trainer's parameters),
then `sync_weights` is timed alone (median of 5, alternating two parameter sets, after the step's own sync).
Rows: the engine's own copy at `--compare REF` (the code before shared weights; default 3e679b4), its own
copy now, and the trainer's arrays shared; then, on a CPU with AMX, both again with `cpu_amx=False` (no
packed copies: the path of a CPU without AMX at float32, and of the GPU and TPU backends, where a shared
sync is a reference swap). Printed per row: RSS after the trainer loaded, after the engine
was built, peak over the GRPO step; the weight bytes the engine shares and holds (`EngineStats`); the
sync's median seconds and the compilations during the timed syncs. The KV cache is the same size in every row (`kv_cache_blocks`).

    python examples/bench_colocated.py                         # the embedded SmolLM2-135M and Qwen3-0.6B shapes
    python examples/bench_colocated.py --models qwen3-0.6b     # random weights of examples/model_configs.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (ROOT, code_at, commit_of, cpu_settings, current_rss_bytes, json_line, mib,  # noqa: E402
                          peak_rss_bytes, print_table, run_worker, use_code)

MODES = ("private", "shared")
# (label, --compare code?, mode, engine config): the CPU backend's packed copies (AMX's layout) are the engine's
# own in both modes and a sync recomputes them; without them (`cpu_amx=False`: Zen 4 at float32, and every GPU
# and TPU backend) a shared sync is a reference swap alone
RUNS = (("own copy @REF", True, "private", ""), ("own copy", False, "private", ""), ("shared", False, "shared", ""),
        ("own copy, no AMX", False, "private", "no-amx"), ("shared, no AMX", False, "shared", "no-amx"))


def worker(model_name: str, mode: str, args: argparse.Namespace) -> dict[str, object]:
    """One row: load, build, one GRPO step, timed syncs; the figures as a dict."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import rl_common as rl
    from rollout import Engine, SamplingParams
    from rollout.tokenizer import load_tokenizer
    from runner.models.loader import load_model
    from weight_sync import CompileCounter

    rss_start = current_rss_bytes()
    if model_name == "smollm2":
        model, _ = load_model(None)
    else:
        from model_configs import materialize

        model, _ = load_model(str(materialize(model_name)))
    tokenizer = load_tokenizer(None)  # prompts are token ids below SmolLM2's vocabulary (every model's)
    cfg = model.config
    first = max(0, cfg.num_hidden_layers - args.train_layers)
    graphdef, trainable, frozen = nnx.split(model, rl.trainable_filter(cfg.num_hidden_layers, args.train_layers), ...)
    tx = optax.adam(1e-5)
    opt_state = tx.init(trainable)
    rss_trainer = current_rss_bytes()

    num_prompts, group, max_tokens, prompt_len = args.prompts, args.group_size, args.max_tokens, 32
    seq_len = prompt_len + max_tokens
    share = {"share_weights": True} if mode == "shared" else {}
    if args.variant == "no-amx":
        share["cpu_amx"] = False
    engine = Engine.from_model(model, tokenizer, max_num_seqs=num_prompts * group, max_model_len=seq_len,
                               kv_cache_blocks=num_prompts * group * -(-seq_len // 16), seed=0, **share)
    rss_engine = current_rss_bytes()

    def loss(trainable: nnx.State, frozen: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
        return rl.policy_loss(trainable, frozen, trainable, batch, graphdef=graphdef, first=first, clip_eps=0.2,
                              kl_coef=0.0, temperature=1.0)[0]

    @jax.jit
    def train_step(trainable: nnx.State, opt_state: optax.OptState, frozen: nnx.State,
                   batch: dict[str, jax.Array]) -> tuple[nnx.State, optax.OptState]:
        grads = jax.grad(loss)(trainable, frozen, batch)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, prompt_len).tolist() for _ in range(num_prompts)]
    params = [SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=j)
              for j in range(num_prompts)]
    t0 = time.perf_counter()
    batch = engine.rollout(prompts, params)
    rollout_s = time.perf_counter() - t0
    rewards = rng.standard_normal(len(batch.group_ids)).astype(np.float32)
    packed = rl.pack(batch, rewards, seq_len, max_tokens)
    t0 = time.perf_counter()
    trainable, opt_state = train_step(trainable, opt_state, frozen, packed)
    jax.block_until_ready(trainable)
    train_s = time.perf_counter() - t0
    nnx.update(model, trainable)
    engine.sync_weights(nnx.state(model, nnx.Param))
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # reads the new weights
    stats = engine.stats()

    previous = jax.tree.map(lambda x: x * 1.0, nnx.state(model, nnx.Param))  # a second parameter set
    jax.block_until_ready(previous)
    trees = [previous, nnx.state(model, nnx.Param)]
    engine.sync_weights(trees[0])
    times = []
    with CompileCounter() as compiles:
        for i in range(5):
            t0 = time.perf_counter()
            engine.sync_weights(trees[1 - i % 2])
            times.append(time.perf_counter() - t0)
    return dict(model=model_name, mode=mode, rss_start=rss_start, rss_trainer=rss_trainer, rss_engine=rss_engine,
                rss_peak=peak_rss_bytes(), weight_bytes_shared=getattr(stats, "weight_bytes_shared", 0),
                weight_bytes_held=getattr(stats, "weight_bytes_held", None),
                param_bytes=sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
                sync_s=statistics.median(times), rollout_s=rollout_s, train_s=train_s,
                sync_compilations=compiles.count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2,qwen3-0.6b", help="smollm2 and/or names of examples/model_configs.py")
    p.add_argument("--compare", default="3e679b4", help="the code before shared weights ('' to skip that row)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--train-layers", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code-root", default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        use_code(args.code_root)
        print(json_line(worker(args.model, args.mode, args)))
        return
    common = ["--prompts", str(args.prompts), "--group-size", str(args.group_size), "--max-tokens",
              str(args.max_tokens), "--train-layers", str(args.train_layers)]
    results = []
    with open("/proc/cpuinfo") as f:  # without AMX the default rows are the no-AMX ones already
        amx = " amx_bf16" in f.read()
    with code_at(args.compare or None) as before:
        for name in args.models.split(","):
            for label, old, mode, variant in RUNS:
                if (old and not before) or (variant == "no-amx" and not amx):
                    continue
                label = label.replace("REF", args.compare)
                r = run_worker(__file__, before if old else ROOT,
                               ["--model", name, "--mode", mode, "--variant", variant, *common])
                results.append(dict(r, label=label))
                print(f"  {name:10s} {label:20s} peak RSS {mib(r['rss_peak'])}", flush=True)
    print(f"\ncommit {commit_of()}; one GRPO step: {args.prompts} prompts x {args.group_size} samples x "
          f"{args.max_tokens} tokens, Adam on the last {args.train_layers} layers; {cpu_settings()}")
    print_table(["model", "engine weights", "RSS trainer", "+ engine", "peak (GRPO step)", "shared", "held",
                 "sync median", "compiles in syncs"],
                [[r["model"], r["label"], mib(r["rss_trainer"]), mib(r["rss_engine"] - r["rss_trainer"]),
                  mib(r["rss_peak"]), mib(r["weight_bytes_shared"]),
                  "" if r["weight_bytes_held"] is None else mib(r["weight_bytes_held"]),
                  f"{r['sync_s'] * 1e3:.3f} ms", r["sync_compilations"]] for r in results])
    summary = {}
    for name in args.models.split(","):
        rows = {r["label"]: r for r in results if r["model"] == name}
        own, shared = rows["own copy"], rows["shared"]
        own_plain, shared_plain = rows.get("own copy, no AMX", own), rows.get("shared, no AMX", shared)
        summary[name] = dict(
            param_bytes=own["param_bytes"], peak_rss_own=own["rss_peak"], peak_rss_shared=shared["rss_peak"],
            peak_rss_saved=own["rss_peak"] - shared["rss_peak"], engine_rss_own=own["rss_engine"] - own["rss_trainer"],
            engine_rss_shared=shared["rss_engine"] - shared["rss_trainer"], sync_s_own=own["sync_s"],
            sync_s_shared=shared["sync_s"], sync_ratio=own["sync_s"] / max(shared["sync_s"], 1e-9),
            weight_bytes_held_shared=shared["weight_bytes_held"], sync_s_own_no_amx=own_plain["sync_s"],
            sync_s_shared_no_amx=shared_plain["sync_s"], peak_rss_own_no_amx=own_plain["rss_peak"],
            peak_rss_shared_no_amx=shared_plain["rss_peak"], weight_bytes_held_shared_no_amx=shared_plain["weight_bytes_held"],
            sync_compilations=max(r["sync_compilations"] for r in rows.values()))
    print(json_line(dict(commit=commit_of(), compare=args.compare, models=summary)))


if __name__ == "__main__":
    main()
