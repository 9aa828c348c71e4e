"""End-to-end tests of `rollout.engine.Engine` on a tiny random Llama (CPU).

Every engine here uses the same model structure (`CFG`), so the compiled step programs are shared
process-wide between engines with the same budgets. The reference for every number is the model's
plain full-sequence forward (`model(ids[None], positions[None])`), i.e. what a trainer recomputes.
"""

from __future__ import annotations

import dataclasses

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.stop_rules import StopChecker
from rollout.sequence import Sequence
from rollout.outputs import RolloutBatch
from rollout.sampling_params import SamplingParams
from weight_sync.compiles import num_compilations
from runner.models.config import ModelConfig
from runner.models.llama import LlamaForCausalLM

VOCAB = 128
EOS = 1
PAD = 0
MAX_LEN = 128
ENGINE_KW = dict(max_num_seqs=8, max_model_len=MAX_LEN, max_num_batched_tokens=64, block_size=16)
CFG = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                  max_position_embeddings=256, eos_token_ids=(EOS,))


class ByteTokenizer:
    """Test double for `rollout.tokenizer.Tokenizer`: one token per ASCII character, EOS = 1, PAD = 0."""

    vocab_size = VOCAB
    eos_token_id = EOS
    eos_token_ids = (EOS,)
    pad_token_id = PAD
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        assert all(i < VOCAB for i in ids), "ByteTokenizer is ASCII only"
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


def make_model(seed: int = 0, eos_logit: float = -6.0) -> LlamaForCausalLM:
    """A tiny Llama with unit-scale random weights (peaked, tie-free logits).

    Every token's embedding carries a constant feature (dimension 0), and the lm_head reads it only
    into the EOS logit: `eos_logit` < 0 makes EOS practically never sampled, > 0 makes it the argmax.
    """
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(seed)

    def init(path: tuple, x: jax.Array) -> jax.Array:
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            a = 1.0 + 0.2 * rng.standard_normal(x.shape)
        elif "embed_tokens" in name:
            a = rng.standard_normal(x.shape)
            a[:, 0] = 4.0
        elif "lm_head" in name:
            a = 3.0 * rng.standard_normal(x.shape) / np.sqrt(x.shape[0])
            a[0, :] = 0.0
            a[0, EOS] = eos_logit
        else:
            a = rng.standard_normal(x.shape) / np.sqrt(x.shape[0])
        return jnp.asarray(a, x.dtype)

    params = jax.tree_util.tree_map_with_path(init, params)
    return nnx.merge(graphdef, params, rest)


class Reference:
    """The full-sequence forward (right-padded to MAX_LEN: causal, so padding changes nothing)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        graphdef, state = nnx.split(model)

        @jax.jit
        def logp(state, ids):
            m = nnx.merge(graphdef, state)
            logits = m(ids[None], jnp.arange(MAX_LEN, dtype=jnp.int32)[None])[0]
            return logits, jax.nn.log_softmax(logits, axis=-1)

        self._fn = lambda ids: logp(state, ids)

    def logits(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(logits, log_softmax) [len(ids), V] at every position of `ids`."""
        padded = np.zeros(MAX_LEN, np.int32)
        padded[:len(ids)] = ids
        logits, logp = self._fn(jnp.asarray(padded))
        return np.asarray(logits[:len(ids)], np.float64), np.asarray(logp[:len(ids)], np.float64)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(min(max_tokens, MAX_LEN - len(prompt))):
            logits, _ = self.logits(ids)
            ids.append(int(np.argmax(logits[-1])))
        return ids[len(prompt):]


def processed_logprobs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """log of the distribution sampled from: temperature, top-k, top-p, renormalized (-inf = filtered)."""
    lg = logits / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-lg, kind="stable")
    keep = np.ones(len(lg), bool)
    if 0 < top_k < len(lg):
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(lg - lg.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        sorted_p = p[order]
        before = np.concatenate([[0.0], np.cumsum(sorted_p)[:-1]])
        drop = before >= top_p
        drop[0] = False
        keep[order[drop]] = False
    out = np.full(len(lg), -np.inf)
    kept = lg[keep]
    out[keep] = kept - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    return out


def observe_steps(runner: object, fn: object) -> object:
    """Wrap `runner.launch` so that `fn(batch, result)` sees (and returns) every step's result when the
    engine collects it; returns the original `launch` (assign it back to undo)."""
    import dataclasses

    inner = runner.launch

    def launch(batch: object, **kwargs: object) -> object:
        pending = inner(batch, **kwargs)
        return dataclasses.replace(pending, finish=lambda host: fn(batch, pending.finish(host)))

    runner.launch = launch
    return inner


def rand_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(2, VOCAB, n)]


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return make_model()


@pytest.fixture(scope="module")
def ref(model) -> Reference:
    return Reference(model)


@pytest.fixture(scope="module")
def engine(model) -> Engine:
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    e.warmup()
    return e


@pytest.fixture(scope="module")
def small_kv_engine(model) -> Engine:
    """KV cache for exactly one max_model_len sequence: batches must be preempted."""
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, kv_cache_blocks=MAX_LEN // 16)


@pytest.fixture(scope="module")
def eos_engine() -> Engine:
    """A model whose argmax is always EOS."""
    return Engine.from_model(make_model(eos_logit=20.0), ByteTokenizer(), **ENGINE_KW)


PROMPTS = [rand_prompt(np.random.default_rng(i), n) for i, n in enumerate([3, 17, 40, 70, 9])]


# ---- greedy and logprobs vs the full forward --------------------------------------------------

def test_greedy_matches_full_forward_loop(engine: Engine, ref: Reference) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        (c,) = out.outputs
        expected = ref.greedy(prompt, 24)
        assert c.token_ids == expected
        assert c.finish_reason == "length" and c.stop_reason is None
        assert c.logprobs is None and c.cumulative_logprob is None


SAMPLING_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_k=8, top_p=0.9),
]


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("case", SAMPLING_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_logprobs_match_full_forward(engine: Engine, ref: Reference, case: dict, mode: str) -> None:
    k = 3
    sp = SamplingParams(**case, n=2, seed=11, max_tokens=12, logprobs=k, logprobs_mode=mode)
    outs = engine.generate(PROMPTS[:4], sp)
    checked = 0
    for prompt, out in zip(PROMPTS[:4], outs):
        for c in out.outputs:
            assert len(c.token_ids) == 12 and len(c.logprobs) == 12
            logits, logp = ref.logits(prompt + c.token_ids)
            for j, (tok, tl) in enumerate(zip(c.token_ids, c.logprobs)):
                pos = len(prompt) - 1 + j
                assert tl.token_id == tok
                if mode == "raw":
                    expected = logp[pos]
                    tol = 1e-5
                else:
                    expected = processed_logprobs(logits[pos], case["temperature"], case.get("top_k", 0),
                                                  case.get("top_p", 1.0))
                    tol = 1e-4
                assert np.isfinite(expected[tok]), "sampled a token outside the processed support"
                assert abs(tl.logprob - expected[tok]) < tol, (mode, j, tl.logprob, expected[tok])
                # top-k alternatives: k entries, sorted descending, the k largest of the expected row.
                ids, lps = list(tl.top), list(tl.top.values())
                assert len(ids) == k
                assert all(a >= b for a, b in zip(lps, lps[1:]))
                assert set(ids) == set(np.argsort(-expected, kind="stable")[:k].tolist())
                for t, v in tl.top.items():
                    if np.isfinite(expected[t]):
                        assert abs(v - expected[t]) < tol
                if tok in tl.top:
                    assert abs(tl.top[tok] - tl.logprob) < 1e-6
                checked += 1
            assert math.isclose(c.cumulative_logprob, sum(t.logprob for t in c.logprobs), rel_tol=1e-5,
                                abs_tol=1e-4)
    assert checked == 4 * 2 * 12


def test_greedy_logprobs(engine: Engine, ref: Reference) -> None:
    (out,) = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
    c = out.outputs[0]
    _, logp = ref.logits(PROMPTS[1] + c.token_ids)
    for j, tl in enumerate(c.logprobs):
        row = logp[len(PROMPTS[1]) - 1 + j]
        assert tl.token_id == int(np.argmax(row))
        assert abs(tl.logprob - row[tl.token_id]) < 1e-5
        assert list(tl.top)[0] == tl.token_id


# ---- seeds and determinism --------------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True)
SEEDED_PROMPT = rand_prompt(np.random.default_rng(99), 13)


@pytest.fixture(scope="module")
def seeded_alone(engine: Engine) -> list[int]:
    (out,) = engine.generate([SEEDED_PROMPT], SEEDED)
    return out.outputs[0].token_ids


def test_same_seed_same_tokens_alone(engine: Engine, seeded_alone: list[int]) -> None:
    (again,) = engine.generate([SEEDED_PROMPT], SEEDED)
    assert again.outputs[0].token_ids == seeded_alone
    other = SamplingParams(temperature=1.0, seed=4321, max_tokens=40, ignore_eos=True)
    (diff,) = engine.generate([SEEDED_PROMPT], other)
    assert diff.outputs[0].token_ids != seeded_alone


def test_same_seed_same_tokens_in_batch_of_64(model: LlamaForCausalLM, seeded_alone: list[int]) -> None:
    big = Engine.from_model(model, ByteTokenizer(), **dict(ENGINE_KW, max_num_seqs=64))
    rng = np.random.default_rng(5)
    prompts = [rand_prompt(rng, int(n)) for n in rng.integers(3, 20, 64)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(64)]
    prompts[37], params[37] = SEEDED_PROMPT, SEEDED
    outs = big.generate(prompts, params)
    assert outs[37].outputs[0].token_ids == seeded_alone
    assert big.stats().num_preemptions == 0


def test_same_seed_same_tokens_after_preemption(small_kv_engine: Engine, seeded_alone: list[int]) -> None:
    rng = np.random.default_rng(6)
    prompts = [rand_prompt(rng, 10) for _ in range(7)] + [SEEDED_PROMPT]  # the seeded one is the newest
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(7)] + [SEEDED]
    before = small_kv_engine.stats().num_preemptions
    outs = small_kv_engine.generate(prompts, params)
    assert small_kv_engine.stats().num_preemptions > before
    assert outs[-1].outputs[0].token_ids == seeded_alone


def test_n_samples_differ_but_are_reproducible(engine: Engine) -> None:
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    a = engine.generate([PROMPTS[2]], sp)[0].outputs
    b = engine.generate([PROMPTS[2]], sp)[0].outputs
    assert [c.index for c in a] == [0, 1, 2, 3]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) == 4


# ---- preemption and prefix caching ------------------------------------------------------------

def test_small_kv_cache_gives_same_greedy_outputs(engine: Engine, small_kv_engine: Engine) -> None:
    rng = np.random.default_rng(8)
    prompts = [rand_prompt(rng, int(n)) for n in rng.integers(5, 30, 8)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    before = small_kv_engine.stats().num_preemptions
    small = small_kv_engine.generate(prompts, sp)
    assert small_kv_engine.stats().num_preemptions > before
    large = engine.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in large]


def test_n8_with_prefix_caching_equals_separate_requests(engine: Engine, ref: Reference) -> None:
    prompt = rand_prompt(np.random.default_rng(123), 50)  # 3 full blocks shareable
    before = engine.stats()
    (out,) = engine.generate([prompt], SamplingParams(n=8, temperature=0.0, max_tokens=16))
    after = engine.stats()
    expected = ref.greedy(prompt, 16)
    assert [c.token_ids for c in out.outputs] == [expected] * 8
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 7 * 48
    separate = engine.generate([prompt] * 8, SamplingParams(temperature=0.0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in separate] == [expected] * 8


@pytest.mark.parametrize("backend", ["jax", "auto"])
def test_shared_preamble_cascade_logprobs_match_full_forward(model, ref: Reference, backend: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts sharing a 70-token preamble: their common cached pages are attended once per step for
    the whole batch (cascade: the pure-JAX path; "auto" takes the C++ kernel on AVX-512 CPUs, which
    reads each sequence's pages), and every sampled logprob still equals the full forward's."""
    import runner.step_padding

    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, attention_backend=backend)
    assert backend == "auto" or engine.stats().attention_impl == "jax"

    seen: list[int] = []
    real = runner.step_padding.num_common_pages
    monkeypatch.setattr(runner.step_padding, "num_common_pages", lambda *a: seen.append(real(*a)) or seen[-1])
    rng = np.random.default_rng(77)
    preamble = rand_prompt(rng, 70)
    prompts = [preamble + rand_prompt(rng, n) for n in (3, 9, 20)]
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=10, logprobs=0))
    assert max(seen) >= 4, seen  # the preamble's 4 full blocks were shared in decode steps
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            _, logp = ref.logits(prompt + c.token_ids)
            got = [t.logprob for t in c.logprobs]
            want = [logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(c.token_ids)]
            np.testing.assert_allclose(got, want, atol=1e-5)


# ---- stopping ---------------------------------------------------------------------------------

def test_eos_stops_and_min_tokens_masks_it(eos_engine: Engine) -> None:
    prompt = PROMPTS[0]
    (plain,) = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))
    assert plain.outputs[0].token_ids == [EOS]
    assert plain.outputs[0].finish_reason == "stop" and plain.outputs[0].stop_reason is None
    for sp in (SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5),
               SamplingParams(temperature=1.0, seed=3, max_tokens=10, min_tokens=5)):
        (out,) = eos_engine.generate([prompt], sp)
        c = out.outputs[0]
        assert len(c.token_ids) >= 5
        assert EOS not in c.token_ids[:5]
        if sp.temperature == 0.0:
            assert c.token_ids[5:] == [EOS] and c.finish_reason == "stop"
    (out,) = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length" and c.token_ids[0] == EOS
    # ignore_eos makes EOS an ordinary token: min_tokens does not mask it (as in vLLM), in the prefill
    # step's sampling and in the multi-step decode calls alike
    (out,) = eos_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=7, min_tokens=5, ignore_eos=True))
    assert out.outputs[0].token_ids == [EOS] * 7


def test_min_tokens_also_masks_stop_token_ids(engine: Engine, ref: Reference) -> None:
    prompt = PROMPTS[1]
    greedy = ref.greedy(prompt, 12)
    stop_id = greedy[0]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))
    assert out.outputs[0].token_ids == [stop_id] and out.outputs[0].stop_reason == stop_id
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3,
                                                      stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert stop_id not in c.token_ids[:3] and len(c.token_ids) >= 3


def _first_new(tokens: list[int], start: int = 1) -> int:
    """First index >= start whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_max_tokens_stop_token_ids_and_stop_strings(engine: Engine, ref: Reference) -> None:
    tok = ByteTokenizer()
    prompt = PROMPTS[2]
    greedy = ref.greedy(prompt, 30)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=9))
    assert out.outputs[0].token_ids == greedy[:9] and out.outputs[0].finish_reason == "length"

    k = _first_new(greedy, 3)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[greedy[k]]))
    c = out.outputs[0]
    assert c.token_ids == greedy[:k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == greedy[k]

    text = tok.decode(greedy)
    k = next(i for i in range(3, len(greedy) - 1) if text[i:i + 2] not in text[:i + 1])
    stop = text[k:k + 2]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop, "\x7f\x7f\x7f"]))
    c = out.outputs[0]
    assert c.token_ids == greedy[:k + 2]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:k]


def test_stop_strings_in_the_first_min_tokens_do_not_count(engine: Engine, ref: Reference) -> None:
    """As in vLLM: the text of the first `min_tokens` tokens is never searched for stop strings, so one
    seen there ends nothing later on; its next occurrence does, and the text ends before that one."""
    tok = ByteTokenizer()
    prompt = PROMPTS[2]
    greedy = ref.greedy(prompt, 40)
    text = tok.decode(greedy)
    a, stop = next((i, ch) for i, ch in enumerate(text[:20]) if ch in text[i + 2:])
    b = text.index(stop, a + 2)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=a + 2, stop=[stop]))
    c = out.outputs[0]
    assert c.token_ids == greedy[:b + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:b]


def test_a_stop_string_completed_by_a_multi_byte_character_is_seen() -> None:
    """A token that completes a UTF-8 character changes the text decoded before it (U+FFFD -> the
    character): the stop-string search starts where the decodes part, not at the old length."""

    class Utf8Bytes:  # one token per byte
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    stops = StopChecker(Utf8Bytes(), eos_token_ids=(), max_model_len=64)  # type: ignore[arg-type]
    seq = Sequence(0, 0, 0, [ord("x")], SamplingParams(stop=["é"], max_tokens=10), seed=0, arrival=0)
    finished = []
    for token in [ord("a"), *"é".encode()]:
        seq.token_ids.append(token)
        finished.append(stops.check(seq, token))
    assert finished == [False, False, True] and seq.out.stop_reason == "é" and seq.out.stop_text_at == 1


def test_prompt_close_to_max_model_len_finishes_with_length(engine: Engine, ref: Reference) -> None:
    prompt = rand_prompt(np.random.default_rng(31), MAX_LEN - 6)  # also needs chunked prefill
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50))
    c = out.outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    assert c.token_ids == ref.greedy(prompt, 6)
    (out,) = engine.generate([rand_prompt(np.random.default_rng(32), MAX_LEN - 1)], SamplingParams(max_tokens=5))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


# ---- prompt logprobs --------------------------------------------------------------------------

def test_prompt_logprobs_match_full_forward(engine: Engine, ref: Reference) -> None:
    prompts = [PROMPTS[2], PROMPTS[3]]  # the second (70 tokens) is prefilled in chunks
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        _, logp = ref.logits(prompt)
        pl = out.prompt_logprobs
        assert len(pl) == len(prompt) and pl[0] is None
        for i in range(1, len(prompt)):
            row = logp[i - 1]
            assert pl[i].token_id == prompt[i]
            assert abs(pl[i].logprob - row[prompt[i]]) < 1e-5
            ids, lps = list(pl[i].top), list(pl[i].top.values())
            assert ids == np.argsort(-row, kind="stable")[:3].tolist()
            assert np.allclose(lps, row[ids], atol=1e-5)


# ---- warm-up ----------------------------------------------------------------------------------

def test_no_compilation_after_warmup(engine: Engine) -> None:
    # conftest's memory-map cleanup may have cleared JAX's in-process caches since the fixture warmed up
    # (the repacking program then compiles at the next sync): warm up again, a no-op otherwise
    engine.warmup()
    rng = np.random.default_rng(77)
    calls = {
        "greedy": ([PROMPTS[0], PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=5)),
        "sampling": (PROMPTS[:3], SamplingParams(temperature=0.8, seed=1, max_tokens=5)),
        "top_p": (PROMPTS[:3], SamplingParams(temperature=1.0, top_p=0.8, seed=1, max_tokens=5)),
        "top_k+min_p": (PROMPTS[:2], SamplingParams(temperature=1.0, top_k=4, min_p=0.05, seed=1, max_tokens=5)),
        "logprobs": (PROMPTS[:2], SamplingParams(temperature=1.0, logprobs=5, max_tokens=5)),
        "processed logprobs": (PROMPTS[:2], SamplingParams(temperature=0.0, logprobs=1, logprobs_mode="processed",
                                                           max_tokens=5)),
        "n>1": ([PROMPTS[2]], SamplingParams(n=6, temperature=1.0, max_tokens=5)),
        "min_tokens+stop": (PROMPTS[:2], SamplingParams(min_tokens=2, stop_token_ids=[5], stop="zz", max_tokens=5)),
        "long prompts (chunked)": ([rand_prompt(rng, 120), rand_prompt(rng, 90), PROMPTS[0]],
                                   SamplingParams(temperature=0.0, max_tokens=5)),
        "full batch": ([rand_prompt(rng, 4) for _ in range(8)], SamplingParams(max_tokens=30)),
        "more than max_num_seqs": ([rand_prompt(rng, 6) for _ in range(13)], SamplingParams(max_tokens=9)),
    }
    compiled = {}
    for name, (prompts, sp) in calls.items():
        before = num_compilations()
        engine.generate(prompts, sp)
        compiled[name] = num_compilations() - before
    assert compiled == {name: 0 for name in calls}, f"compilations after warmup(): {compiled}"
    from flax import nnx

    before = num_compilations()  # a weight sync (and the repacking of packed kernels it implies) neither
    engine.sync_weights(nnx.state(engine.model, nnx.Param))
    engine.generate(*calls["full batch"])
    assert num_compilations() == before, "a sync after warmup() compiled"


def test_no_compilation_after_warmup_prompt_logprobs(model: LlamaForCausalLM) -> None:
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    e.warmup(prompt_logprobs=True)
    before = num_compilations()
    e.generate([PROMPTS[1]], SamplingParams(max_tokens=2, prompt_logprobs=1))
    e.generate([PROMPTS[2]], SamplingParams(max_tokens=2, prompt_logprobs=0, logprobs=2))
    assert num_compilations() == before


# ---- validation -------------------------------------------------------------------------------

BAD_PARAMS = [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.1), dict(top_k=-2), dict(n=0), dict(max_tokens=0),
    dict(min_tokens=5, max_tokens=4), dict(min_p=1.5), dict(logprobs=-2), dict(stop=[""]), dict(seed=-1),
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=str)
def test_bad_sampling_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_input_raises_before_any_state_change(engine: Engine) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    good = PROMPTS[1]
    expected = engine.generate([good], sp)[0].outputs[0].token_ids
    bad_calls = [
        ("", sp), ([], sp), ([[]], sp), ([good, []], sp),
        ([[5] * MAX_LEN], sp), ("x" * MAX_LEN, sp),
        ([[5, VOCAB]], sp), ([[5, -1]], sp), ([good, [3, 4, 999]], sp),
        ([good], SamplingParams(logprobs=engine.config.max_logprobs + 1)),
        ([good], SamplingParams(prompt_logprobs=engine.config.max_logprobs + 1)),
        ([good, good], [sp]),
        ([good], "not params"),
    ]
    bad_calls += [([good], SamplingParams(stop_token_ids=[VOCAB])), ([good], SamplingParams(stop_token_ids=[2**40]))]
    for prompts, params in bad_calls:
        state = (len(engine.core.requests), engine.stats().num_sequences, len(engine.core.scheduler.waiting),
                 engine.core.block_manager.num_free_blocks)
        with pytest.raises(ValueError):
            engine.generate(prompts, params)
        assert not engine.core.scheduler.has_unfinished()
        assert (len(engine.core.requests), engine.stats().num_sequences, len(engine.core.scheduler.waiting),
                engine.core.block_manager.num_free_blocks) == state, prompts
    assert engine.generate([good], sp)[0].outputs[0].token_ids == expected
    assert engine.generate(ByteTokenizer().decode(good), sp)[0].outputs[0].token_ids == expected


def test_a_failed_step_leaves_no_prefix_cached(engine: Engine, ref: Reference, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """A step whose blocks were published for prefix sharing but never computed (the device call failed)
    must not serve them later: the next call with the same prompt recomputes its K/V."""
    prompt = rand_prompt(np.random.default_rng(77), 40)  # two full blocks of 16

    def lost(batch: object) -> None:
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "launch", lost)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert not engine.core.scheduler.has_unfinished()
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == ref.greedy(prompt, 8)


def test_engine_config_is_validated_before_any_load() -> None:
    for bad in (dict(seed=-1), dict(seed=1.5), dict(max_logprobs=-2), dict(max_logprobs=2.0)):
        with pytest.raises(ValueError, match="seed|max_logprobs"):
            Engine.from_pretrained("/nonexistent/checkpoint", **bad)  # the config fails first


def test_top_k_past_int32_means_off(engine: Engine) -> None:
    """A top_k larger than the vocabulary (even past int32) keeps every token, like 0."""
    good = PROMPTS[1]
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=6)
    want = engine.generate([good], sp)[0].outputs[0].token_ids
    for k in (VOCAB, 2**40):
        assert engine.generate([good], dataclasses.replace(sp, top_k=k))[0].outputs[0].token_ids == want


def test_top_k_zero_and_minus_one_both_mean_off(engine: Engine) -> None:
    outs = [engine.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=9, top_k=k, max_tokens=12,
                                                         logprobs=0))[0].outputs[0] for k in (0, -1)]
    assert outs[0].token_ids == outs[1].token_ids
    assert [t.logprob for t in outs[0].logprobs] == [t.logprob for t in outs[1].logprobs]


def test_max_tokens_beyond_max_model_len_generates_to_the_end(engine: Engine) -> None:
    prompt = rand_prompt(np.random.default_rng(41), MAX_LEN - 10)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1000))
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


# ---- rollout ----------------------------------------------------------------------------------

def test_rollout_batch_matches_full_forward(engine: Engine, model: LlamaForCausalLM) -> None:
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    batch = engine.rollout(prompts, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, logprobs=0))
    assert isinstance(batch, RolloutBatch)
    b, t = batch.input_ids.shape
    assert b == 9
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.prompt_lens.tolist() == [len(p) for p in prompts for _ in range(3)]
    assert (batch.completion_lens == batch.completion_mask.sum(1)).all()
    assert (batch.attention_mask.sum(1) == batch.prompt_lens + batch.completion_lens).all()
    assert t == int((batch.prompt_lens + batch.completion_lens).max())
    assert batch.loss_mask.shape == batch.logprobs.shape == (b, t - 1)
    assert int(batch.loss_mask.sum()) == int(batch.completion_lens.sum())
    for r in range(b):
        p, n = batch.prompt_lens[r], batch.completion_lens[r]
        assert batch.input_ids[r, :p].tolist() == prompts[batch.group_ids[r]]
        assert batch.input_ids[r, p:p + n].tolist() == batch.completion_ids[r, :n].tolist()
        assert (batch.input_ids[r, p + n:] == batch.pad_id).all()
        assert np.allclose(batch.completion_logprobs[r, :n], batch.logprobs[r, p - 1:p - 1 + n])
    logits = model(jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask))
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[:, :-1]
    target = np.take_along_axis(logp, batch.input_ids[:, 1:, None], axis=-1)[..., 0]
    mask = batch.loss_mask > 0
    assert np.abs(target[mask] - batch.logprobs[mask]).max() < 1e-5
    assert (batch.logprobs[~mask] == 0).all()
    assert batch.finish_reasons == ("length",) * 9


FAMILIES = {
    "qwen2": dict(family="qwen2", qkv_bias=True),
    "qwen3": dict(family="qwen3", qk_norm=True, tie_word_embeddings=True),
    "llama-bfloat16": dict(family="llama", dtype="bfloat16", param_dtype="bfloat16"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollout_logprobs_equal_the_trainer_forward_for_each_family(family: str) -> None:
    """The RL contract on every model family: `rollout()`'s sampled-token logprobs are what the trainer's
    `model(...)` computes over prompt + completion (biases, Q/K norms, tied head and every norm scale
    random, so each path counts). float32 within 1e-5 (measured ~2e-6); bfloat16 within 0.1 (the paged step
    and the dense forward round bfloat16 activations at different points: measured 0.038 here)."""
    cfg = dataclasses.replace(CFG, **FAMILIES[family])
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(4)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: (x + 0.2 * rng.standard_normal(x.shape)).astype(x.dtype), state))
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    batch = engine.rollout([PROMPTS[0], PROMPTS[2]], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12,
                                                                    logprobs=0, ignore_eos=True))
    logits = model(jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask))
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[:, :-1]
    target = np.take_along_axis(logp, batch.input_ids[:, 1:, None], axis=-1)[..., 0]
    mask = batch.loss_mask > 0
    worst = np.abs(target[mask] - batch.logprobs[mask]).max()
    assert worst < (0.1 if "bfloat16" in family else 1e-5), worst
    assert np.std(target[mask]) > 0.1  # not a flat distribution: the comparison has something to check


def test_logprob_counts_are_per_request_in_a_mixed_batch(engine: Engine) -> None:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    params = [SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=2),
              SamplingParams(max_tokens=4, logprobs=5),
              SamplingParams(max_tokens=4, prompt_logprobs=0, logprobs=0)]
    outs = engine.generate(prompts, params)
    assert [len(t.top) for t in outs[0].outputs[0].logprobs] == [1] * 4
    assert [len(t.top) for t in outs[0].prompt_logprobs[1:]] == [2] * (len(prompts[0]) - 1)
    assert [len(t.top) for t in outs[1].outputs[0].logprobs] == [5] * 4
    assert outs[1].prompt_logprobs is None
    assert [len(t.top) for t in outs[2].outputs[0].logprobs] == [0] * 4
    assert [len(t.top) for t in outs[2].prompt_logprobs[1:]] == [0] * (len(prompts[2]) - 1)
