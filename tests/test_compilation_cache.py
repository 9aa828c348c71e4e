"""The persistent compilation cache and the executable store: a second process builds and warms up the same
engine loading every step program's executable (no trace, no compile), and generates the same tokens
(with the CPU backend's FFI kernels in the programs); a code change or a damaged file means compiling
again; bad settings are refused."""

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
from weight_sync.compiles import num_compilations
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
                      loaded=engine.runner.num_loaded_programs, repacks=int(engine.runner.backend.packs_weights),
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


def test_a_second_process_loads_the_step_programs(tmp_path: Path) -> None:
    code = WORKER.format(tests=str(Path(__file__).parent), cache=str(tmp_path / "cache"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    def run() -> dict:
        return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                         env=env).stdout.strip().splitlines()[-1])

    first, second = runs = [run(), run()]
    assert first["tokens"] == second["tokens"]
    # every step program the first process compiled, the second loads as an executable (no trace, no
    # compile); a backend that packs weights (AMX on a CPU that has it; none on one without) has one more
    # program, the repacking a weight sync runs, which comes from JAX's persistent cache (the rest of
    # `compilations` is the model's random initialisation and eager ops, too quick to be cached)
    repacks = first["repacks"]
    assert repacks == second["repacks"] in (0, 1), runs
    assert first["hits"] == 0 and first["loaded"] == 0 and first["programs"] > 5, runs
    assert second["loaded"] == first["programs"] - repacks and second["hits"] >= repacks, runs
    assert second["compilations"] <= first["compilations"] - second["loaded"], runs
    stored = sorted((tmp_path / "cache" / "executables").glob("*.exe"))
    assert len(stored) == first["programs"] - repacks
    # JAX's persistent cache filled but no executables: they are compiled afresh (an executable loaded
    # from JAX's cache serializes without some of its kernels), and the next process runs them
    for path in stored:
        path.unlink()
    refill, third = run(), run()
    assert refill["tokens"] == third["tokens"] == first["tokens"] and third["loaded"] == first["programs"] - repacks


@pytest.mark.parametrize("bad", ["", 3, b"dir"])
def test_bad_cache_dir_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        EngineConfig(compilation_cache_dir=bad)


def test_a_code_change_or_a_damaged_file_compiles_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine import ENGINE_KW, ByteTokenizer, make_model

    from rollout.engine import Engine
    from rollout.sampling_params import SamplingParams
    from runner import executable_store

    def build() -> Engine:
        executable_store.open_store.cache_clear()  # as a new process: nothing loaded in memory
        return Engine.from_model(make_model(0), ByteTokenizer(), compilation_cache_dir=str(tmp_path),
                                 **{**ENGINE_KW, "num_scheduler_steps": 1})

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = build()
    tokens = first.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    files = sorted((tmp_path / "executables").glob("*.exe"))
    assert len(files) == 2 and first.runner.num_loaded_programs == 0  # a prefill and a decode program
    again = build()
    assert again.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids == tokens
    assert again.runner.num_loaded_programs == 2
    files[0].write_bytes(files[0].read_bytes()[:100])  # a truncated file: compiled again and rewritten
    damaged = build()
    assert damaged.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids == tokens
    assert damaged.runner.num_loaded_programs == 1 and files[0].stat().st_size > 100
    monkeypatch.setattr(executable_store, "code_version", lambda: "edited")  # other code: other keys
    edited = build()
    assert edited.generate([[5, 6, 7]], sp)[0].outputs[0].token_ids == tokens
    assert edited.runner.num_loaded_programs == 0 and len(list((tmp_path / "executables").glob("*.exe"))) == 4
