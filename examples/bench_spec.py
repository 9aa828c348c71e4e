"""Workload R3 (docs/benchmarks.md): n-gram speculative decoding vs plain decoding.

Prompt i: a fixed paragraph of ~150 tokens followed by `Repeat the paragraph above exactly:`, sent as
one user message through the tokenizer's chat template (`--no-chat` sends the raw text instead).
B in {1, 8} prompts, greedy, 128 new tokens (max_tokens = 128; a sequence may stop at EOS), on the
embedded SmolLM2-135M-Instruct in float32. The plain engine has its defaults (multi-step decode,
8 steps per device call; a speculative engine verifies every step, so it runs one). All engines live
in one process on the same prompts and take turns call by call (plain, then each speculative variant,
`--repeats` rounds), so a slow spell of the machine hits them alike: tokens/s = generated tokens /
wall seconds of the whole generate call, median of the rounds, after `engine.warmup()` and one
untimed warm-up call each; the prefix cache is cleared before every call. Reports, per speculative
engine, the ratio to plain, mean tokens emitted per sequence per verification step, the acceptance
rate, the share of decode steps auto-disable skipped, the share of draft steps an unsure EAGLE-3
head decoded plainly (`--min-confidence`), and whether the outputs are identical token for token.

EAGLE-3 (`--eagle DIR`, a head in the published layout, e.g. from `examples/train_eagle3.py`): the
drafter is that head instead of n-gram lookup, on workload R1's ordinary prompts (`Question {i}: ...`,
raw text, 128 new tokens with EOS ignored as in R1; `--workload r3` keeps the R3 prompts), default
B = 1 and k = 3; `--sampling` adds a temperature-1 run (seed 0).

Run: `python examples/bench_spec.py` (full), `--quick` (smoke test: B = 1, 32 tokens, 1 repeat),
`--k 4`, `--batch-sizes 1,8`, `--repeats 3`, `--no-auto-disable`, `--auto-disable both` (a speculative engine
with and one without), `--json-out out.json`, `--eagle examples/results/eagle3-smollm2`,
`--min-confidence 0,0.5` (one speculative engine per value), `--verify-steps 1,4` (EAGLE-3 draft-verify steps
per device call, one engine per value), `--num-prompts 8` (prompts 0..7 queued
through a B-sequence engine: with B = 1 each runs alone). Ends with one JSON line holding every figure.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import itertools  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

import bench_common as bc  # noqa: E402

PARAGRAPHS = [
    "The lighthouse at the end of the harbor was built in 1871 from granite blocks carried by ship from a quarry "
    "up the coast. For more than a century its keepers climbed one hundred and twelve steps every evening to "
    "light the lamp, wind the clockwork that turned the lens, and record the weather in a leather logbook. "
    "When the light was automated in 1984, the last keeper moved into the village, where she taught the "
    "children to read the tides, tie a bowline, and tell a tern from a gull by the shape of its wings. "
    "Today the tower is a small museum, and on clear nights its beam still reaches twenty miles out to sea.",
    "Bread begins with only four ingredients: flour, water, salt, and yeast. When the flour is mixed with water, "
    "two proteins join to form gluten, a stretchy network that traps the gas the yeast releases as it feeds on "
    "sugars. Kneading strengthens this network, and a long, cool rise lets the flavor develop slowly. Before "
    "baking, the loaf is shaped tightly and slashed across the top so that it can expand in the hot oven "
    "without tearing. The crust browns as sugars and proteins react at high heat, while the inside sets "
    "into a soft crumb full of small holes. A good loaf should sound hollow when tapped on the bottom.",
    "Honeybees live in colonies of tens of thousands of workers, a few hundred drones, and a single queen. "
    "A worker's job changes as she ages: she first cleans cells, then feeds the young larvae, builds wax comb, "
    "guards the entrance, and finally flies out to gather nectar and pollen from flowers. When a forager "
    "finds a rich patch of flowers, she returns to the hive and performs a waggle dance, whose angle tells "
    "her sisters the direction of the food relative to the sun and whose length tells them the distance. "
    "In winter the bees cluster together and shiver their flight muscles to keep the queen warm.",
    "The old railway line across the valley closed in 1962, and for years its bridges and cuttings were "
    "slowly taken back by brambles and young birch trees. In 2005 a group of volunteers cleared the track "
    "bed, repaired the stone viaduct, and laid a gravel path along the whole route. Now walkers and cyclists "
    "follow the gentle gradient for eleven miles, passing a restored signal box, two tunnels lit by small "
    "lamps, and a station platform where a cafe serves tea and cake on weekends. In spring the banks are "
    "covered with primroses, and in autumn the beech woods above the line turn a deep copper red.",
]
INSTRUCTION = "Repeat the paragraph above exactly:"


def prompt_ids(tok: Any, i: int, chat: bool) -> list[int]:
    text = f"{PARAGRAPHS[i % len(PARAGRAPHS)]}\n\n{INSTRUCTION}"
    if chat:
        return list(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True))
    return tok.encode(text)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: B = 1, 32 new tokens, 1 repeat")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per step (<= 7; default 4, EAGLE-3: 3)")
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per run, median reported (default 3)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per sequence (default 128)")
    ap.add_argument("--no-chat", action="store_true", help="raw prompt text instead of the chat template")
    ap.add_argument("--no-auto-disable", action="store_true", help="draft on every decode step (= --auto-disable off)")
    ap.add_argument("--auto-disable", choices=("on", "off", "both"), default=None,
                    help="skip drafting when measured slower (default on); both: one speculative engine of each")
    ap.add_argument("--json-out", default=None, help="also write the final JSON line to this file")
    ap.add_argument("--eagle", default=None, help="draft with this EAGLE-3 head directory instead of n-gram lookup")
    ap.add_argument("--workload", choices=("r1", "r3"), default=None, help="prompts (default: r3; r1 with --eagle)")
    ap.add_argument("--sampling", action="store_true", help="also run temperature 1.0 (seed 0)")
    ap.add_argument("--min-confidence", default=None,
                    help="EAGLE-3: decode plainly in steps where every first draft's probability is below this "
                         "(default: the engine's, 0 = always verify); comma-separated: one "
                         "speculative engine per value")
    ap.add_argument("--verify-steps", default=None,
                    help="EAGLE-3: draft-verify steps per device call (Eagle3Config.num_verify_steps; default: the "
                         "engine's); comma-separated: one speculative engine per value")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts i = 0..N-1 per run (default B); with N > B they queue and run B at a time "
                         "(max_num_seqs = B), e.g. --batch-sizes 1 --num-prompts 8: eight prompts each at B = 1")
    args = ap.parse_args()
    default_batches = "1" if args.quick or args.eagle else "1,8"
    args.batch_sizes = [int(b) for b in (args.batch_sizes or default_batches).split(",")]
    if args.num_prompts and len(args.batch_sizes) > 1:  # the engines' max_num_seqs is the largest B
        ap.error("--num-prompts takes one batch size (--batch-sizes B): the prompts then run B at a time")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.max_tokens = args.max_tokens or (32 if args.quick else 128)
    args.workload = args.workload or ("r1" if args.eagle else "r3")
    args.k = args.k or (3 if args.eagle else 4)
    if args.min_confidence is not None and not args.eagle:
        ap.error("--min-confidence is an EAGLE-3 setting (--eagle DIR)")
    args.min_confidence = [None] if args.min_confidence is None else [float(c) for c in args.min_confidence.split(",")]
    if args.verify_steps is not None and not args.eagle:
        ap.error("--verify-steps is an EAGLE-3 setting (--eagle DIR)")
    args.verify_steps = [None] if args.verify_steps is None else [int(v) for v in args.verify_steps.split(",")]
    auto = args.auto_disable or ("off" if args.no_auto_disable else "on")
    args.auto_disable = {"on": [True], "off": [False], "both": [True, False]}[auto]
    return args


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(sequence, token index) where two runs' outputs first differ; None when identical."""
    for s, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return s, next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


def spec_counters(before: Any, after: Any, engine: Any) -> dict[str, Any]:
    """What a speculative engine's timed calls did: tokens per step, acceptance, skipped and unsure shares."""
    s0, s1 = before.speculative, after.speculative
    delta = {f.name: getattr(s1, f.name) - getattr(s0, f.name)
             for f in dataclasses.fields(s1) if f.name != "acceptance_by_version"}
    steps = delta["num_draft_steps"] + delta["num_disabled_steps"]
    return dict(
        mean_accepted_per_step=delta["emitted_tokens"] / delta["num_seq_steps"] if delta["num_seq_steps"] else 0.0,
        acceptance_rate=delta["accepted_tokens"] / delta["drafted_tokens"] if delta["drafted_tokens"] else 0.0,
        disabled_share=delta["num_disabled_steps"] / steps if steps else 0.0,
        unsure_share=delta["num_unsure_steps"] / delta["num_draft_steps"] if delta["num_draft_steps"] else 0.0,
        spec_counters=delta,
        step_seconds=dict(sorted(engine.core.speculator.step_seconds.items())))


def main() -> None:
    args = parse_args()
    from rollout import Eagle3Config, Engine, NgramConfig, SamplingParams

    kw = dict(max_num_seqs=max(args.batch_sizes), max_model_len=512)
    plain = Engine.from_pretrained(None, **kw)
    variants: list[tuple[str, Any]] = []  # (name, speculative engine), all on the plain engine's model
    for auto, conf, steps in itertools.product(args.auto_disable, args.min_confidence, args.verify_steps):
        eagle_kw = {} if conf is None else dict(min_confidence=conf)
        eagle_kw |= {} if steps is None else dict(num_verify_steps=steps)
        cfg = (Eagle3Config(args.eagle, k=args.k, auto_disable=auto, **eagle_kw) if args.eagle else
               NgramConfig(k=args.k, prompt_lookup_min=1, prompt_lookup_max=3, auto_disable=auto))
        engine = Engine.from_model(plain.model, plain.tokenizer, **kw, speculative=cfg)
        name = "spec" + (f" conf={engine.runner.draft_min_confidence:g} vs={engine.runner.num_verify_steps}"
                         if args.eagle else "")
        variants.append((name + ("" if auto else " always"), engine))
    tok = plain.tokenizer
    # Every bucket up front: a verification step's row count follows the draft lengths, so a warm-up
    # call of the same prompts does not compile them all (a compile inside a timed call costs seconds).
    engines = [("plain", plain)] + variants
    for _, engine in engines:
        engine.warmup()
    r1 = args.workload == "r1"
    modes = [("greedy", dict(temperature=0.0))] + ([("t1.0", dict(temperature=1.0, seed=0))] if args.sampling else [])
    drafter = f"EAGLE-3 {args.eagle}" if args.eagle else "n-gram"
    resolved = sorted({e.runner.draft_min_confidence for _, e in variants}) if args.eagle else None
    unsure = f", min_confidence={resolved}" if args.eagle else ""
    print(f"{args.workload.upper()} speculative decoding ({drafter}): k={args.k}{unsure}, auto_disable={args.auto_disable}, "
          f"chat={not args.no_chat and not r1}, {args.max_tokens} new tokens, median of {args.repeats} "
          f"(engines' calls interleaved); plain engine: num_scheduler_steps={plain.config.num_scheduler_steps} "
          f"(its default); {bc.cpu_settings()}")

    rows, runs = [], []
    for batch, (mode, sp_kw) in [(b, m) for b in args.batch_sizes for m in modes]:
        # R1: exactly max_tokens new tokens (EOS ignored); R3: a sequence may stop at EOS
        sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=r1, **sp_kw)
        num_prompts = max(args.num_prompts or batch, batch)
        prompts = ([tok.encode(bc.r1_prompt(i)) for i in range(num_prompts)] if r1
                   else [prompt_ids(tok, i, not args.no_chat) for i in range(num_prompts)])
        before, seconds, outs = {}, {name: [] for name, _ in engines}, {}
        for name, engine in engines:
            engine.core.block_manager.invalidate_prefix_cache()
            engine.generate(prompts, sp)  # untimed warm-up (compiles), outside the counters below
            before[name] = engine.stats()
        for _ in range(args.repeats):  # the engines take turns, so a slow spell of the machine hits them alike
            for name, engine in engines:
                engine.core.block_manager.invalidate_prefix_cache()
                t, _, out, _ = bc.timed_median(lambda e=engine: e.generate(prompts, sp), 1, warmup=False)
                seconds[name].append(t)
                outs[name] = [c.token_ids for o in out for c in o.outputs]
        tokens = sum(len(t) for t in outs["plain"])
        plain_s = statistics.median(seconds["plain"])
        for name, engine in variants:
            after = engine.stats()
            spec_s = statistics.median(seconds[name])
            diff = first_difference(outs["plain"], outs[name])
            result: dict[str, Any] = dict(
                batch=batch, mode=mode, variant=name, num_prompts=num_prompts, prompt_tokens=[len(p) for p in prompts],
                min_confidence=engine.runner.draft_min_confidence if args.eagle else None,
                num_verify_steps=engine.runner.num_verify_steps if args.eagle else None,
                auto_disable=engine.core.speculator.config.auto_disable, new_tokens=tokens,
                plain_tok_s=tokens / plain_s, plain_seconds=plain_s, plain_seconds_all=seconds["plain"],
                spec_tok_s=sum(len(t) for t in outs[name]) / spec_s, spec_seconds=spec_s, spec_seconds_all=seconds[name],
                compilations_timed={n: e.stats().num_compilations - before[n].num_compilations for n, e in engines},
                **spec_counters(before[name], after, engine), first_difference=diff, identical=diff is None)
            result["ratio"] = result["spec_tok_s"] / result["plain_tok_s"]
            runs.append(result)
            rows.append([batch, num_prompts, mode, name, tokens, f"{result['plain_tok_s']:.1f}", f"{result['spec_tok_s']:.1f}",
                         f"{result['ratio']:.2f}x", f"{result['mean_accepted_per_step']:.2f}",
                         f"{result['acceptance_rate']:.2f}", f"{result['disabled_share']:.2f}", f"{result['unsure_share']:.2f}",
                         "True" if diff is None else "False (seq {}, token {})".format(*diff)])
        if batch == args.batch_sizes[0]:
            print("sample output:", repr(tok.decode(outs[variants[0][0]][0])[:200]))

    bc.print_table(["B", "prompts", "mode", "engine", "new tokens", "plain tok/s", "spec tok/s", "ratio", "tokens/step",
                    "accept rate", "disabled", "unsure", "identical"], rows)
    print(bc.json_line(dict(bench=f"spec-{args.workload.upper()}", drafter=drafter, k=args.k, auto_disable=args.auto_disable,
                            min_confidence=resolved,
                            plain_num_scheduler_steps=plain.config.num_scheduler_steps, chat=not args.no_chat and not r1,
                            max_tokens=args.max_tokens, repeats=args.repeats, runs=runs,
                            all_identical=all(r["identical"] for r in runs)), args.json_out))


if __name__ == "__main__":
    main()
