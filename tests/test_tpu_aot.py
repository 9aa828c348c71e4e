"""The engine's step programs compiled for real TPU chips by libtpu, on a machine without a TPU
(`runner.tpu_aot`). Runs in `.venv-tpu` (`.ci/run`: `jax[tpu]`), skipped where libtpu is absent.

The engine's own runner over an abstract model (shapes only) runs `warmup()` on a TPU topology's devices:
every step program it would compile (multi-step decode calls, prefill steps) is compiled for the chip,
the Pallas ragged kernel through Mosaic included, and reports its memory. The embedded SmolLM2 (whose
heads the kernel cannot tile: zero-padded) on one v5e chip and on a data-parallel v5e:2x2 slice (the
kernel per replica under shard_map), Gemma-3-1B's layers (head_dim 256, one KV head, sliding windows) on
v6e. The TPU backend compiles one bucket per step kind (a decode loop, a ragged step), at the budgets'
sizes: the default model on one v5e chip takes `tpu_aot.SMALL`'s (8 sequences, 128 tokens a step); the
other cases, whose point is the mesh or the heads, and the measure test (CPU programs of the real model)
take smaller ones (2 sequences, 32 tokens), which compile and run faster. `examples/tpu_aot.py` compiles
the full model x chip x mesh matrix (docs/tpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import pytest

if TYPE_CHECKING:
    from runner.build import RunnerOptions
    from runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="needs libtpu (`.ci/run` runs this file in .venv-tpu with jax[tpu])")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


@pytest.fixture(scope="module")
def aot():  # noqa: ANN201  (the example module)
    import tpu_aot  # sets JAX's platform to CPU for libtpu's compiler (runner.tpu_aot.prepare_aot)

    return tpu_aot


@pytest.fixture(scope="module")
def tiny(aot) -> RunnerOptions:  # noqa: ANN001
    """Small budgets: a decode loop of 2 sequences, a ragged step of 32 tokens."""
    return dataclasses.replace(aot.SMALL, max_num_seqs=2, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def compiled(aot, tiny: RunnerOptions) -> Callable[..., ModelRunner]:  # noqa: ANN001
    """`aot.compile_all`'s runner, compiled once per (model, mesh, vocabulary, budgets) in this module;
    `small`: `aot.SMALL`'s budgets, else `tiny`'s."""
    return functools.cache(lambda model, mesh, vocab=None, small=False: aot.compile_all(
        model, mesh, aot.SMALL if small else tiny, vocab_size=vocab)[0])


@pytest.mark.parametrize("model, mesh, vocab, small, kernel", [
    ("smollm2", "v5e:1x1:1x1", None, True, "heads 9 query / 3 KV -> 12 / 4, head_dim 64 -> 128"),
    ("smollm2", "v5e:2x2:4x1", None, False, "heads 9 query / 3 KV -> 12 / 4, head_dim 64 -> 128"),
    # tensor parallel: the kernel on each device's 3 query heads / 1 KV head under shard_map over `model`
    ("smollm2", "v5e:2x2:1x4", None, False, "on each of 4 devices' heads, zero-padded for the kernel: head_dim 64 -> 128"),
    # Gemma-3-1B's layers with SmolLM2's vocabulary: its 262,144-id sampler sort alone compiles for minutes
    ("gemma-3-1b", "v6e:1x1:1x1", 49152, False, "the model's heads (4 query / 1 KV, head_dim 256)"),
])
def test_every_warmup_program_compiles_for_the_chip(aot, compiled, model: str, mesh: str,  # noqa: ANN001
                                                     vocab: int | None, small: bool, kernel: str) -> None:
    runner = compiled(model, mesh, vocab, small)
    kinds = sorted((w.kind, w.program.name) for w in runner.warmup_programs)
    assert kinds == [("decode_loop", "chunk"), ("ragged", "step")]  # every program of this runner's warmup()
    status = runner.backend.status()
    assert status.attention == "tpu_ragged" and kernel in status.attention_kernel
    topology, (data, model_axis) = aot.parse_mesh(mesh)
    for w in runner.warmup_programs:
        devices = jax.tree.leaves(w.program.compiled.input_shardings)[0].device_set
        assert {d.device_kind for d in devices} == {aot.CHIPS[topology.split(":")[0]].kind}
        assert len(devices) == data * model_axis
        memory = aot.ProgramMemory.of(w.program)
        assert memory.argument_bytes > 0 and memory.code_bytes > 0


def test_measure_times_the_steps_predictions_name(aot, compiled, tiny: RunnerOptions) -> None:  # noqa: ANN001
    """`--predict --measure-on-tpu` on a TPU VM: `measure` runs a real runner through the same dummy steps the
    predictions are for and keys its times by the same labels. Here it runs on the CPU (the backend the
    platform picks), which proves everything but the chip."""
    runner = compiled("smollm2", "v5e:1x1:1x1")
    predicted = {aot.step_label(w.plan) for w, _ in aot.predictions(runner, "v5e")}
    measured = aot.measure("smollm2", "v5e:1x1:1x1", tiny)
    assert set(measured) == predicted and all(0.0 < t < 60.0 for t in measured.values())
