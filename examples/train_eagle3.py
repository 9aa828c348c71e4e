"""Train an EAGLE-3 draft head for SmolLM2-135M-Instruct on its own generations (2-core CPU, < 20 min).

1. The engine generates greedy continuations (128 tokens, EOS ignored, as in workload R1) of R1-style
   prompts i = 1000, 1001, ... (the benchmark's prompts i = 0..7 stay held out).
2. The target's full-sequence forward gives the three auxiliary hidden states (layers 2, 15, 27)
   and its greedy next token at every position (the labels).
3. The head (one Llama layer; lm_head over a draft vocabulary of the most frequent labels, started
   from the target's output rows; norm from the target's final norm) trains with Optax AdamW on
   cross-entropy at every training-time-test step (EAGLE-3: steps 2..k feed the head's own output),
   until `--minutes` of training are spent.
4. It is saved in the published layout (`config.json`, `model.safetensors` with `d2t`/`t2d`), and
   the mean accepted length per verification step on the held-out prompts is printed before
   (random head) and after training.

Run: `python examples/train_eagle3.py` (default output `examples/results/eagle3-smollm2/`),
`--quick` (smoke test: a few prompts, a few steps). Ends with one JSON line.
Then: `python examples/bench_spec.py --eagle examples/results/eagle3-smollm2`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import bench_common as bc  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "eagle3-smollm2")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="where the trained head is saved")
    ap.add_argument("--quick", action="store_true", help="smoke test: 16 prompts, 32 tokens, 4 steps")
    ap.add_argument("--num-prompts", type=int, default=320, help="training prompts (i = 1000, 1001, ...)")
    ap.add_argument("--max-tokens", type=int, default=128, help="generated tokens per training prompt")
    ap.add_argument("--minutes", type=float, default=11.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size")
    ap.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (= drafting steps k)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts i = 0..N-1")
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.max_steps, args.eval_prompts, args.eval_tokens = 16, 32, 4, 2, 16
    return args


def acceptance(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Mean tokens per verification step and acceptance rate of greedy decoding of `prompts`."""
    from rollout import SamplingParams

    before = engine.stats().speculative
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    after = engine.stats().speculative
    steps = after.num_seq_steps - before.num_seq_steps
    drafted = after.drafted_tokens - before.drafted_tokens
    return dict(mean_accepted_per_step=(after.emitted_tokens - before.emitted_tokens) / max(steps, 1),
                acceptance_rate=(after.accepted_tokens - before.accepted_tokens) / max(drafted, 1))


def main() -> None:
    args = parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from rollout import Eagle3Config, Engine, SamplingParams
    from runner.spec_decode.eagle3_checkpoint import init_eagle3_head, save_eagle3_head
    from runner.spec_decode.eagle3_train import eagle3_loss, target_features, target_to_draft

    t_start = time.perf_counter()
    engine = Engine.from_pretrained(None, max_num_seqs=64, max_model_len=512)
    model, tok = engine.model, engine.tokenizer
    k = args.ttt_steps

    # 1. the target's own generations
    train_prompts = [tok.encode(bc.r1_prompt(1000 + i)) for i in range(args.num_prompts)]
    outs = engine.generate(train_prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    length = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length), np.float32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], mask[i, :len(s)] = s, 1.0
    t_generated = time.perf_counter()

    # 2. features and labels, a few sequences at a time
    cfg_layers = init_eagle3_head(model).config.aux_layer_ids
    feats = nnx.jit(lambda m, ids, msk: target_features(m, ids, cfg_layers, msk))  # weights as arguments
    aux_parts, label_parts = [], []
    for i in range(0, len(seqs), 16):
        a, lab = feats(model, jnp.asarray(tokens[i:i + 16]), jnp.asarray(mask[i:i + 16], jnp.int32))
        aux_parts.append(np.asarray(a))
        label_parts.append(np.asarray(lab))
    aux, labels = np.concatenate(aux_parts), np.concatenate(label_parts)
    t_features = time.perf_counter()

    # 3. the head: draft vocabulary = the most frequent labels
    counts = np.bincount(labels[mask > 0].ravel(), minlength=model.config.vocab_size)
    draft_vocab = np.argsort(-counts, kind="stable")[:args.draft_vocab]
    head = init_eagle3_head(model, draft_vocab_ids=draft_vocab, seed=0)
    t2d = jnp.asarray(target_to_draft(head))
    coverage = float(counts[draft_vocab].sum() / counts.sum())

    eval_prompts = [tok.encode(bc.r1_prompt(i)) for i in range(args.eval_prompts)]
    untrained_dir = os.path.join(args.out, "untrained")
    save_eagle3_head(head, untrained_dir)
    spec_kw = dict(max_num_seqs=max(8, args.eval_prompts), max_model_len=512)
    before = acceptance(Engine.from_model(model, tok, **spec_kw, speculative=Eagle3Config(
        untrained_dir, k=k, auto_disable=False)), eval_prompts, args.eval_tokens)

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, max(args.max_steps, 100), args.lr * 0.05)
    opt = nnx.Optimizer(head, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)

    @nnx.jit
    def train_step(head: Any, opt: Any, target: Any, a: jax.Array, ids: jax.Array, lab: jax.Array, m: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        def loss_fn(h: Any) -> tuple[jax.Array, jax.Array]:
            return eagle3_loss(h, target, a, ids, lab, m, t2d, k)
        (loss, accs), grads = nnx.value_and_grad(loss_fn, has_aux=True)(head)
        opt.update(head, grads)
        return loss, accs

    rng = np.random.default_rng(0)
    budget = args.minutes * 60
    t_train = time.perf_counter()
    step, log = 0, []
    while step < args.max_steps and time.perf_counter() - t_train < budget:
        idx = rng.choice(len(seqs), args.batch, replace=False)
        loss, accs = train_step(head, opt, model, jnp.asarray(aux[idx]), jnp.asarray(tokens[idx]), jnp.asarray(labels[idx]),
                                jnp.asarray(mask[idx]))
        step += 1
        if step % 25 == 0 or step == 1:
            log.append(dict(step=step, loss=float(loss), acc=[round(float(x), 3) for x in accs],
                            seconds=round(time.perf_counter() - t_train, 1)))
            print(f"step {step}: loss {float(loss):.3f}, top-1 per TTT step {log[-1]['acc']}, "
                  f"{log[-1]['seconds']} s", flush=True)
    t_trained = time.perf_counter()

    save_eagle3_head(head, args.out)
    after = acceptance(Engine.from_model(model, tok, **spec_kw, speculative=Eagle3Config(
        args.out, k=k, auto_disable=False)), eval_prompts, args.eval_tokens)
    total = time.perf_counter() - t_start

    bc.print_table(["head", "tokens / verification step", "acceptance rate"], [
        ["random (before)", f"{before['mean_accepted_per_step']:.2f}", f"{before['acceptance_rate']:.2f}"],
        ["trained (after)", f"{after['mean_accepted_per_step']:.2f}", f"{after['acceptance_rate']:.2f}"]])
    print(f"saved to {args.out}; {step} steps; total {total / 60:.1f} min "
          f"(generate {t_generated - t_start:.0f} s, features {t_features - t_generated:.0f} s, "
          f"train {t_trained - t_train:.0f} s)")
    print(bc.json_line(dict(bench="train-eagle3", out=args.out, k=k, steps=step, train_sequences=len(seqs),
                            train_tokens=int(mask.sum()), draft_vocab=len(draft_vocab), label_coverage=coverage,
                            before=before, after=after, total_minutes=total / 60, log=log,
                            cpu=bc.cpu_settings()), args.json_out))


if __name__ == "__main__":
    main()
