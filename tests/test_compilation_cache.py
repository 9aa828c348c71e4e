"""The persistent compilation cache: a second process builds and warms up the same engine loading every
step program from the cache, and generates the same tokens (with the CPU backend's FFI kernels in the
programs); bad settings are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.engine_config import EngineConfig

WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from runner.compile_counter import num_compilations
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt
import numpy as np
import jax
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(1) if name.endswith("cache_hits") else None)
before = num_compilations()
engine = Engine.from_model(make_model(0), ByteTokenizer(), compilation_cache_dir={cache!r}, **ENGINE_KW)
programs = engine.warmup()
outs = engine.generate([rand_prompt(np.random.default_rng(i), 9) for i in range(3)],
                       SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True))
print(json.dumps(dict(programs=programs, compilations=num_compilations() - before, hits=len(hits),
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


def test_a_second_process_loads_the_step_programs(tmp_path: Path) -> None:
    code = WORKER.format(tests=str(Path(__file__).parent), cache=str(tmp_path / "cache"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                      env=env).stdout.strip().splitlines()[-1]) for _ in range(2)]
    first, second = runs
    assert first["tokens"] == second["tokens"]
    # every step program the first process compiled, the second loads (`num_compilations` counts both)
    assert first["hits"] == 0 and second["hits"] >= first["programs"] > 5, runs
    assert any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("bad", ["", 3, b"dir"])
def test_bad_cache_dir_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        EngineConfig(compilation_cache_dir=bad)
