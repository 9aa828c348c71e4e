"""Compile the engine's step programs for real TPU chips on a machine without one, and predict step times.

Needs `jax[tpu]` (libtpu) in the environment (`bash examples/bench_tpu.sh --aot` makes one). For each
model x topology x mesh, the engine's own runner over an abstract model runs `warmup()`, which compiles
every step program for the chips (`runner.tpu_aot.compile_warmup`); each program's compiled memory per
device is printed. `--predict` then prints a predicted step time (`runner.tpu_aot.predict_step`: XLA's
cost analysis, plus the attention kernel's K/V bytes by formula) for R1 decode steps at B = 1, 8, 64 and an
R2 prefill step, with the fraction of the chip's HBM roofline that implies. Predictions, not measurements.

    python examples/tpu_aot.py                              # every model, chip and mesh below
    python examples/tpu_aot.py --models smollm2 --meshes v5e:1x1:1x1 --predict
    python examples/tpu_aot.py --models smollm2 --meshes v5e:1x1:1x1 --predict   # on a TPU: also measured
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runner.tpu_aot import prepare_aot  # noqa: E402

if "--measure-on-tpu" not in sys.argv:
    prepare_aot()  # before JAX starts a backend

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model_configs import hf_config_dict  # noqa: E402
from flax import nnx  # noqa: E402

from runner.build import RunnerOptions, build_runner  # noqa: E402
from runner.models.registry import build_model, config_from_hf  # noqa: E402
from runner.sharding import make_mesh  # noqa: E402
from runner.model_runner import ModelRunner  # noqa: E402
from runner.tpu_attention import TpuRaggedAttention  # noqa: E402
from runner.warmup_steps import WarmupProgram  # noqa: E402
from runner.step_plan import StepPlan  # noqa: E402
from runner.models.loader import read_checkpoint  # noqa: E402
from runner.models.config import ModelConfig  # noqa: E402
from runner.models.default_model import default_model_path  # noqa: E402
from runner.tpu_aot import CHIPS, ProgramMemory, StepPrediction, compile_warmup, kv_bytes, predict_step, topology_mesh  # noqa: E402

MODELS = ("smollm2", "qwen3-0.6b", "gemma-3-1b")
# topology:data x model; tensor parallel and data parallel on a 2x2 v5e slice
MESHES = ("v5e:1x1:1x1", "v5e:2x2:1x4", "v5e:2x2:4x1", "v6e:1x1:1x1")
# The warmup set compiled per model x mesh: the engine's programs (multi-step decode calls of 8 steps,
# prefill steps) for its smallest buckets: one libtpu compile takes 20-40 s here (half of it the sampler's
# full-vocabulary sort), so every bucket of every configuration would take hours. `--full` takes the
# engine's default budgets (64 sequences, 512 tokens per step, top logprobs: 14 programs per configuration).
SMALL = RunnerOptions(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, max_logprobs=0,
                      num_scheduler_steps=8)
FULL = RunnerOptions(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024, num_scheduler_steps=8)
# Predictions: single decode steps (XLA's cost analysis does not multiply a device loop's body by its trip
# count) at R1's shapes (22-token prompts + 128 new tokens: a 160-token context), the KV cache sized to
# them (XLA counts each layer's in-place K/V scatter as a pass over that layer's whole cache).
PREDICT = RunnerOptions(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=160, max_logprobs=0,
                        num_scheduler_steps=1)


def model_config(name: str) -> ModelConfig:
    """bfloat16, as on a TPU: the embedded SmolLM2's config from its GGUF, the others from model_configs."""
    hf = read_checkpoint(default_model_path()).hf_config if name == "smollm2" else hf_config_dict(name)
    return config_from_hf(hf, dtype="bfloat16")


def parse_mesh(spec: str) -> tuple[str, tuple[int, int]]:
    name, kind, shape = spec.rsplit(":", 2)
    data, model = (int(x) for x in shape.split("x"))
    return f"{name}:{kind}", (data, model)


def compile_all(model: str, mesh_spec: str, options: RunnerOptions, vocab_size: int | None = None
                ) -> tuple[ModelRunner, float]:
    """`model`'s runner with every warm-up program compiled for `mesh_spec`'s chips, and the seconds it took;
    `vocab_size` replaces the model's (a shorter compile of the sampler's full-vocabulary sort)."""
    topology, shape = parse_mesh(mesh_spec)
    start = time.perf_counter()
    on_tpu = jax.devices()[0].platform == "tpu"  # `--measure-on-tpu`: this machine's chips, not a described slice
    cfg = model_config(model)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    runner = compile_warmup(cfg, make_mesh(shape) if on_tpu else topology_mesh(topology, shape), options)
    return runner, time.perf_counter() - start


def predictions(runner: ModelRunner, chip: str) -> list[tuple[WarmupProgram, StepPrediction]]:
    """A prediction for every single-step program the runner compiled, at its own dummy step's shapes
    (`PREDICT`: every sequence at a 160-token context, as R1's at its end; prefill steps of 128-token pieces)."""
    spec = runner.kv_spec
    itemsize = np.dtype(spec.dtype).itemsize
    weights = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(runner.params))
    own = 2 * spec.num_kv_heads * spec.head_dim * itemsize * spec.num_layers  # K/V bytes per token, unpadded
    kernel = runner.attention if isinstance(runner.attention, TpuRaggedAttention) else None
    per_block = kernel.blocks.queries if kernel is not None else 32
    out = []
    for w in runner.warmup_programs:
        q_lens, kv_lens = w.plan.tokens.q_lens.tolist(), w.plan.tokens.kv_lens.tolist()
        read = kv_bytes(None if kernel is None else kernel.shape, spec.num_layers, itemsize, q_lens, kv_lens, per_block)
        cache = sum(int(np.prod(c.shape)) * c.dtype.itemsize for c in runner.kv_caches) // runner.kv_spec.num_replicas
        out.append((w, predict_step(w.program, CHIPS[chip], weight_bytes=weights, kv_read=read,
                                    kv_ideal=sum(kv_lens) * own, cache_bytes=cache)))
    return out


def measure(model: str, mesh_spec: str, options: RunnerOptions) -> dict[str, float]:
    """On a TPU: the same dummy steps run by a real runner (random weights), median seconds of 5 after one.
    The TPU backend always (its buckets are the predictions'; off a TPU its attention is the pure-JAX path)."""
    _, shape = parse_mesh(mesh_spec)
    runner = build_runner(build_model(model_config(model), rngs=nnx.Rngs(0)), make_mesh(shape),
                          dataclasses.replace(options, backend="tpu"))
    times = {}
    for step in runner.dummy_steps.every_bucket(prompt_logprobs=False, speculative_k=0, rejection=False):
        runner.run(step)
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            runner.run(step)
            samples.append(time.perf_counter() - start)
        times[step_label(step)] = float(np.median(samples))
    return times


def step_label(plan: StepPlan) -> str:
    return f"{plan.kind} {plan.num_seqs} seqs / {len(plan.tokens.token_ids)} tokens"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default=",".join(MESHES), help="topology:data x model, e.g. v5e:2x2:1x4")
    ap.add_argument("--full", action="store_true", help="the engine's default buckets (14 programs per configuration)")
    ap.add_argument("--predict", action="store_true", help="only predicted step times, on one chip of each mesh's kind")
    ap.add_argument("--measure-on-tpu", action="store_true",
                    help="on a TPU VM: compile for its chips and time the same steps (with --predict)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    where = "this TPU's chips" if args.measure_on_tpu else "TPU chips with libtpu (no TPU here)"
    print(f"jax {jax.__version__}; compiling for {where}; devices: {jax.devices()[0].device_kind}")
    rows, preds = [], []
    print(f"{'model':<12} {'mesh':<14} {'prog':<6} {'dummy step (bucket)':<32} {'top':>4} {'args MiB':>9} "
          f"{'out MiB':>9} {'temp MiB':>9}")
    for model in args.models.split(","):
        for mesh in args.meshes.split(","):
            runner, seconds = compile_all(model, mesh, PREDICT if args.predict else FULL if args.full else SMALL)
            for w in runner.warmup_programs:
                mem = ProgramMemory.of(w.program)
                step = f"{w.kind} {w.num_seqs} seqs / {w.num_tokens} tokens"
                print(f"{model:<12} {mesh:<14} {w.program.name:<6} {step:<32} {w.num_top_logprobs:>4} "
                      f"{mem.argument_bytes / 2**20:>9.1f} {mem.output_bytes / 2**20:>9.1f} {mem.temp_bytes / 2**20:>9.1f}")
                rows.append(dict(model=model, mesh=mesh, program=w.program.name, kind=w.kind, num_seqs=w.num_seqs,
                                 num_tokens=w.num_tokens, num_top_logprobs=w.num_top_logprobs, **dataclasses.asdict(mem)))
            status = runner.backend.status()
            print(f"  {len(runner.compiled_programs)} programs compiled in {seconds:.0f} s; attention "
                  f"{status.attention}; {status.attention_kernel or 'no kernel'}")
            topology, shape = parse_mesh(mesh)
            if args.predict:
                measured = measure(model, mesh, PREDICT) if jax.devices()[0].platform == "tpu" else {}
                for w, pred in predictions(runner, topology.split(":")[0]):
                    label = step_label(w.plan)
                    ratio = (f"  measured {measured[label] * 1e3:.3f} ms = {measured[label] / pred.predicted_seconds:.2f}x"
                             if label in measured else "")
                    xla = f"{pred.optimal_seconds * 1e3:.3f} ms" if pred.optimal_seconds > 0 else "n/a"
                    print(f"  predicted {label:<32} {pred.predicted_seconds * 1e3:>8.3f} ms  XLA's estimate {xla}"
                          f"  {pred.bytes_accessed / 1e6:>8.1f} MB (kernel K/V {pred.kv_bytes / 1e6:.1f} MB)"
                          f"  roofline {pred.roofline_fraction:.2f}; without the cache scatter's count "
                          f"{pred.scatter_free_seconds * 1e3:.3f} ms, roofline {pred.scatter_free_roofline_fraction:.2f}{ratio}")
                    preds.append(dict(model=model, mesh=mesh, step=label, measured_seconds=measured.get(label),
                                      **dataclasses.asdict(pred)))
    summary = dict(bench="tpu_aot", jax=jax.__version__, num_programs=len(rows), predictions=preds)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(dict(programs=rows, **summary), indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
