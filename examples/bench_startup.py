"""Start-up with and without JAX's persistent compilation cache: two processes, back to back.

    python examples/bench_startup.py            # the embedded SmolLM2-135M, float32
    python examples/bench_startup.py --tiny     # a random 2-layer model (quick)

Each process builds `Engine.from_pretrained(...)` with a compilation cache in a fresh temporary folder,
runs `warmup()` (every step bucket of the config: max_num_seqs 64, max_model_len 512, 512 batched
tokens), then one R1 call (B = 8, 32 greedy tokens). The first process compiles and fills the cache; the
second loads from it. Prints both start-ups (construction + warm-up), the ratio second / first (target
<= 0.25), compilations each process counted, and whether both produced the same tokens. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_common as bc

CONFIG = dict(max_num_seqs=64, max_model_len=512, max_num_batched_tokens=512)


def worker(cache_dir: str, tiny: bool) -> None:
    t0 = time.perf_counter()
    from rollout import Engine, SamplingParams, load_tokenizer
    from weight_sync.compiles import num_compilations

    before = num_compilations()
    if tiny:
        import rl_common as rl

        tok = load_tokenizer(None)
        engine = Engine.from_model(rl.tiny_model(tok.vocab_size, tok.eos_token_ids), tok,
                                   compilation_cache_dir=cache_dir, **CONFIG)
    else:
        engine = Engine.from_pretrained(None, compilation_cache_dir=cache_dir, **CONFIG)
    built = time.perf_counter() - t0
    programs = engine.warmup()
    ready = time.perf_counter() - t0
    outs = engine.generate([bc.r1_prompt(i) for i in range(8)], SamplingParams(temperature=0.0, max_tokens=32))
    print(json.dumps(dict(build_s=built, start_s=ready, programs=programs, compilations=num_compilations() - before,
                          tokens=[o.outputs[0].token_ids for o in outs])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--worker", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.tiny)
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(2):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", cache] + (["--tiny"] if args.tiny else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        size = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())
    first, second = runs
    ratio = second["start_s"] / first["start_s"]
    bc.print_table(["process", "build s", "build + warmup s", "programs", "compilations"],
                   [[name, f"{r['build_s']:.1f}", f"{r['start_s']:.1f}", r["programs"], r["compilations"]]
                    for name, r in (("first (empty cache)", first), ("second (cache filled)", second))])
    same = first["tokens"] == second["tokens"]
    print(f"second / first start-up: {ratio:.2f}   same tokens: {same}   cache size: {bc.mib(size)}")
    print(bc.json_line(dict(bench="startup", model="tiny" if args.tiny else "SmolLM2-135M", first_start_s=first["start_s"],
                            second_start_s=second["start_s"], ratio=ratio, first_compilations=first["compilations"],
                            second_compilations=second["compilations"], programs=first["programs"],
                            same_tokens=same, cache_bytes=size)))


if __name__ == "__main__":
    main()
