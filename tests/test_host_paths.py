"""The host's fast paths (issue: host overhead) against the plain code they replace: a call launched
ahead takes the previous call's rows instead of rebuilding them, block tables are padded in one copy,
and the engine freezes the collector's heap after start-up without keeping dead engines alive."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np

import rollout.engine_core as engine_core
from rollout import Engine, SamplingParams
from rollout.plan_builder import build_plan
from runner.step_padding import block_table_array
from test_engine import ENGINE_KW, ByteTokenizer, make_model, rand_prompt


def test_ahead_step_equals_the_rebuilt_step(monkeypatch) -> None:
    """Every call launched ahead in a run with min_tokens, stop ids, logprobs, EOS and several lengths
    carries what rebuilding it from the sequences gives, for every input the device reads."""
    checked = []
    derived = engine_core.ahead_plan

    def compare(prev, batch, kept, prev_rows):
        step = derived(prev, batch, kept, prev_rows)
        done = prev.loop.num_steps[np.asarray(kept)]
        fresh = build_plan(batch, engine.core.eos_token_ids)
        fresh_tokens = dataclasses.replace(fresh.tokens, positions=fresh.tokens.positions + done,
                                           kv_lens=fresh.tokens.kv_lens + done)
        fresh_loop = dataclasses.replace(fresh.loop, suppress_steps=np.maximum(fresh.loop.suppress_steps - done, 0))
        for name in ("positions", "kv_lens", "q_lens", "replicas"):
            np.testing.assert_array_equal(getattr(step.tokens, name), getattr(fresh_tokens, name), err_msg=name)
        for name in ("num_steps", "suppress_steps", "stop_ids"):
            np.testing.assert_array_equal(getattr(step.loop, name), getattr(fresh_loop, name), err_msg=name)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "sample_index", "want_logprob"):
            np.testing.assert_array_equal(getattr(step.sampling.rows, name), getattr(fresh.sampling.rows, name),
                                          err_msg=name)
        # suppressed ids only count while suppress_steps does (the device masks them for those steps)
        live = step.loop.suppress_steps > 0
        np.testing.assert_array_equal(step.sampling.suppress_ids[live], fresh.sampling.suppress_ids[live])
        assert step.tokens.block_tables == fresh.tokens.block_tables and step.kind == "decode_loop"
        assert ((step.sampling.num_top_logprobs, step.sampling.sampling_record)
                == (fresh.sampling.num_top_logprobs, fresh.sampling.sampling_record))
        np.testing.assert_array_equal(step.loop.feed_rows, np.asarray(prev_rows, np.int32))
        checked.append(int(live.sum()))
        return step

    monkeypatch.setattr(engine_core, "ahead_plan", compare)
    rng = np.random.default_rng(7)
    prompts = [rand_prompt(rng, int(n)) for n in rng.integers(3, 30, 8)]
    params = [SamplingParams(temperature=[0.0, 0.8][i % 2], seed=i, max_tokens=int(rng.integers(20, 70)),
                             min_tokens=[0, 12, 40][i % 3], logprobs=[None, 0, 2][i % 3],
                             stop_token_ids=[5 + i] if i % 4 == 1 else None,
                             stop=["~~"] if i == 2 else None) for i in range(8)]  # (token by token on the host)
    engine = Engine.from_model(make_model(3, eos_logit=1.0), ByteTokenizer(), **ENGINE_KW, freeze_gc=False)
    outs = engine.generate(prompts, params)
    assert engine.stats().num_ahead_calls == len(checked) > 3
    assert engine.stats().generated_tokens == sum(len(c.token_ids) for out in outs for c in out.outputs)
    assert any(checked)  # some calls launched ahead still suppressed EOS (min_tokens)


def test_block_table_array_pads_like_a_row_by_row_copy() -> None:
    rng = np.random.default_rng(0)
    tables = [list(rng.integers(0, 500, int(n))) for n in rng.integers(0, 12, 40)] + [[]]
    for width in (1, 5, 12, 16):
        want = np.zeros((len(tables), width), np.int32)
        for i, blocks in enumerate(tables):
            want[i, :min(len(blocks), width)] = blocks[:width]
        np.testing.assert_array_equal(block_table_array(tables, width), want)
    assert block_table_array([], 4).shape == (0, 4)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_gc_freezes_the_heap_and_the_next_engine_collects_dead_cycles() -> None:
    model = make_model(0)
    gc.unfreeze()
    Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, freeze_gc=False)
    assert gc.get_freeze_count() == 0
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)  # freezes `cycle` with everything else
    assert gc.get_freeze_count() > 0
    del cycle
    gc.collect()
    assert ref() is not None  # frozen: a full collection skips it
    Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)  # a new engine collects what died frozen
    assert ref() is None and gc.get_freeze_count() > 0
