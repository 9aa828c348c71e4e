"""EAGLE-3 drafting: checkpoint layout, drafts against a numpy reference, exactness in the engine, sync.

The tiny Llama of `tests/test_engine.py` is the target. Two heads: a random one (drafts are rarely
accepted) and one trained here for a few seconds on the target's greedy outputs (drafts are often
accepted, so the accept/rollback paths of verification run). Every draft the engine makes is
checked against an independent numpy forward of the head over the sequence's full history: that
covers the head's paged cache, which the engine fills after every prefill, decode and
verification step (rejected positions included).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rollout import Eagle3Config, Engine, SamplingParams
from weight_sync.compiles import num_compilations
from runner.spec_decode.eagle3 import Eagle3Head
from runner.spec_decode.eagle3_checkpoint import init_eagle3_head, load_eagle3_head, save_eagle3_head
from runner.spec_decode.eagle3_train import eagle3_loss, pack_sequences, target_features, target_to_draft
from weight_sync import WeightSyncError
from test_engine import CFG, ENGINE_KW, MAX_LEN, ByteTokenizer, make_model, observe_steps, rand_prompt
from test_spec_decode import CASES, assert_same, assert_same_distributions, assert_target_logprobs

K = 3
DRAFT_VOCAB = np.arange(2, 98)[::-1].copy()  # 96 of the 128 ids, reordered: d2t offsets are not trivial


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def plain(model) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)


@pytest.fixture(scope="module")
def random_head_dir(model, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("eagle3_random"))
    save_eagle3_head(init_eagle3_head(model, seed=3), path)
    return path


def prompts_for(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rand_prompt(rng, int(rng.integers(4, 24))) for _ in range(count)]


def train_head(model, plain: Engine, draft_vocab: np.ndarray | None, steps: int = 150) -> Eagle3Head:
    """A head trained on the target's greedy continuations of random prompts (a few seconds)."""
    outs = plain.generate(prompts_for(1, 48), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    tokens, mask = pack_sequences(seqs)
    head = init_eagle3_head(model, draft_vocab_ids=draft_vocab, seed=4)
    aux, labels, _ = target_features(model, jnp.asarray(tokens), head.config.aux_layer_ids,
                                     jnp.asarray(mask, jnp.int32))
    t2d = jnp.asarray(target_to_draft(head))
    opt = nnx.Optimizer(head, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(head: Eagle3Head, opt: nnx.Optimizer) -> jax.Array:
        def loss_fn(h: Eagle3Head) -> jax.Array:
            return eagle3_loss(h, model, aux, jnp.asarray(tokens), labels, jnp.asarray(mask), t2d, K)[0]
        loss, grads = nnx.value_and_grad(loss_fn)(head)
        opt.update(head, grads)
        return loss

    first = float(step(head, opt))
    for _ in range(steps):
        last = float(step(head, opt))
    assert last < 0.5 * first, (first, last)
    return head


@pytest.fixture(scope="module")
def trained_head_dir(model, plain, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("eagle3_trained"))
    save_eagle3_head(train_head(model, plain, DRAFT_VOCAB), path)
    return path


def test_rejection_mode_samples_the_target_distribution(model, plain: Engine, trained_head_dir) -> None:
    """EAGLE-3 with rejection sampling at T=1 and top-p (drafts made on the device, accepted with
    probability min(1, p/q)): at every position the tokens of 400 samples come from plain decoding's
    distribution (chi-square homogeneity), drafts get accepted, and the logprobs are the target's."""
    rejection = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, auto_disable=False, verification="rejection"))
    start = prompts_for(61, 1)[0]
    lead = plain.generate([start], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    prompt = start + list(lead.outputs[0].token_ids)  # the head was trained on such greedy continuations
    sp = SamplingParams(n=400, temperature=1.0, top_p=0.95, seed=9, max_tokens=4, logprobs=0, ignore_eos=True)
    got = rejection.generate([prompt], sp)[0].outputs
    want = plain.generate([prompt], sp)[0].outputs
    assert rejection.stats().speculative.accepted_tokens >= 50
    assert_same_distributions(got, want, range(1, 4))
    assert_target_logprobs(plain, prompt, got[:5])


@pytest.fixture(scope="module")
def spec(model, trained_head_dir) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW,
                             speculative=Eagle3Config(trained_head_dir, k=K, auto_disable=False))


# ---- an independent numpy reference of the head -------------------------------------------------

def np_params(head: Eagle3Head) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v.value, np.float64) for k, v in nnx.to_flat_state(nnx.state(head))}


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    d = x.shape[-1]
    ang = pos / theta ** (np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.concatenate([ang, ang])), np.sin(np.concatenate([ang, ang]))
    return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1) * sin


def reference_drafts(head: Eagle3Head, target, tokens: list[int], steps: int, forced: list[int] | None = None
                     ) -> tuple[list[int], list[np.ndarray]]:
    """Greedy drafts (target ids) after `tokens` (the last one not yet computed by the target), and
    each step's layer output; `forced` feeds those tokens instead of the drafts (teacher forcing)."""
    cfg, p = head.config, np_params(head)
    eps, hd, nq, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    c = len(tokens) - 1
    padded = np.zeros(-(-c // 64) * 64, np.int32)  # few distinct shapes: eager ops reuse their compilations
    padded[:c] = tokens[:c]  # causal, so the padding after them changes nothing
    aux, _, _ = target_features(target, jnp.asarray(padded[None]), cfg.aux_layer_ids)
    g = np.asarray(aux[0, :c], np.float64) @ p["fc.kernel"]
    emb = np.asarray(target.embed_tokens[...], np.float64)
    target_out = emb.T if target.lm_head is None else np.asarray(target.lm_head.kernel[...], np.float64)
    out_w = p["lm_head.kernel"] if cfg.has_lm_head else target_out
    d2t = p["d2t"].astype(np.int64) if cfg.has_lm_head else np.zeros(cfg.vocab_size, np.int64)
    m = "midlayer."

    def layer(hidden: np.ndarray, tok: int, pos: int, keys: list, values: list) -> np.ndarray:
        feats = np.concatenate([rms(emb[tok], p[m + "input_layernorm.scale"], eps),
                                rms(hidden, p[m + "hidden_norm.scale"], eps)])
        q = (feats @ p[m + "self_attn.q_proj.kernel"]).reshape(nq, hd)
        keys.append(rope((feats @ p[m + "self_attn.k_proj.kernel"]).reshape(nkv, hd), pos, cfg.rope_theta))
        values.append((feats @ p[m + "self_attn.v_proj.kernel"]).reshape(nkv, hd))
        q = rope(q, pos, cfg.rope_theta)
        kk, vv = np.stack(keys), np.stack(values)  # [n, Hkv, D]
        o = np.zeros((nq, hd))
        for h in range(nq):
            s = kk[:, h // (nq // nkv)] @ q[h] / np.sqrt(hd)
            w = np.exp(s - s.max())
            o[h] = (w / w.sum()) @ vv[:, h // (nq // nkv)]
        x = hidden + o.reshape(-1) @ p[m + "self_attn.o_proj.kernel"]
        y = rms(x, p[m + "post_attention_layernorm.scale"], eps)
        gate, up = y @ p[m + "mlp.gate_proj.kernel"], y @ p[m + "mlp.up_proj.kernel"]
        return x + (gate / (1 + np.exp(-gate)) * up) @ p[m + "mlp.down_proj.kernel"]

    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for pos in range(c - 1):  # the head's cache: (g_p, token p + 1) at every earlier position
        layer(g[pos], tokens[pos + 1], pos, keys, values)
    hidden, tok, drafts, outs = g[c - 1], tokens[c], [], []
    for j in range(steps):
        x = layer(hidden, tok, c - 1 + j, keys, values)
        d = int(np.argmax(rms(x, p["norm.scale"], eps) @ out_w))
        drafts.append(d + int(d2t[d]))
        outs.append(x)
        hidden, tok = x, (forced[j] if forced is not None and j < len(forced) else drafts[-1])
    return drafts, outs


def record_drafts(engine: Engine) -> list[tuple[list[int], list[int]]]:
    """Wrap the engine's verification steps: every (sequence history, its K drafts made on the device) pair."""
    log: list[tuple[list[int], list[int]]] = []
    histories: list[list[int]] = []
    inner_drafts = engine.core.speculator.draft_fn

    def drafting(seqs, limits):
        histories[:] = [list(s.token_ids) for s in seqs]
        return inner_drafts(seqs, limits)

    def run(batch, result):
        if result.draft_ids is not None and result.verified and result.steps == 1:  # an unsure step's drafts are -1
            assert result.draft_ids.shape == (1, len(histories), K)
            log.extend((h, d.tolist()) for h, d in zip(histories, result.draft_ids[0]))
        elif result.draft_ids is not None and result.steps > 1:  # multi-step verification: replay acceptance
            num_seqs = len(histories)
            assert result.draft_ids.shape == (result.steps, num_seqs, K)
            steps = batch.loop.num_steps[::K + 1]  # per sequence (each has K + 1 rows)
            for i in range(result.steps):
                for s in np.flatnonzero(steps > i):
                    drafts = result.draft_ids[i, s].tolist()
                    log.append((list(histories[s]), drafts))
                    rows = result.token_ids[i, s * (K + 1):][:K + 1].tolist()
                    accepted = next((j for j in range(K) if drafts[j] != rows[j]), K)
                    histories[s] += rows[:accepted + 1]
        return result

    engine.core.speculator.draft_fn = drafting
    observe_steps(engine.runner, run)
    return log


# ---- checkpoint layout ----------------------------------------------------------------------------

@pytest.mark.parametrize("draft_vocab", [None, DRAFT_VOCAB], ids=["shared-lm-head", "draft-vocab"])
def test_checkpoint_round_trip(model, tmp_path, draft_vocab) -> None:
    head = init_eagle3_head(model, draft_vocab_ids=draft_vocab, seed=1)
    save_eagle3_head(head, str(tmp_path))
    loaded = load_eagle3_head(str(tmp_path), CFG)
    a, b = nnx.state(head), nnx.state(loaded)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    from safetensors.numpy import load_file
    names = set(load_file(str(tmp_path / "model.safetensors")))
    expected = {"fc.weight", "norm.weight", *(f"midlayer.{n}.weight" for n in (
        "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
    if draft_vocab is not None:
        expected |= {"lm_head.weight", "d2t", "t2d"}
    assert names == expected
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == (len(draft_vocab) if draft_vocab is not None else CFG.vocab_size)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)


def test_checkpoint_from_pytorch_bin(model, tmp_path) -> None:
    """The authors' releases ship `pytorch_model.bin` (int64 d2t, bool t2d): it loads without torch
    at run time and gives the same head as the safetensors layout."""
    import torch
    from safetensors.numpy import load_file

    st_dir, bin_dir = tmp_path / "st", tmp_path / "bin"
    save_eagle3_head(init_eagle3_head(model, draft_vocab_ids=DRAFT_VOCAB, seed=3), str(st_dir))
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((st_dir / "config.json").read_text())
    tensors = load_file(str(st_dir / "model.safetensors"))
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, bin_dir / "pytorch_model.bin")
    a, b = nnx.state(load_eagle3_head(str(st_dir), CFG)), nnx.state(load_eagle3_head(str(bin_dir), CFG))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_checkpoint_errors_list_every_problem(model, tmp_path) -> None:
    from safetensors.numpy import load_file, save_file
    save_eagle3_head(init_eagle3_head(model, draft_vocab_ids=DRAFT_VOCAB), str(tmp_path))
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    del tensors["norm.weight"]
    tensors["midlayer.extra.weight"] = np.zeros(3, np.float32)
    tensors["fc.weight"] = tensors["fc.weight"][:, :5]
    tensors["t2d"] = ~tensors["t2d"]
    save_file(tensors, file)
    with pytest.raises(ValueError) as err:
        load_eagle3_head(str(tmp_path), CFG)
    msg = str(err.value)
    for part in ("'norm.scale' is not in the checkpoint", "'midlayer.extra.weight' matches no EAGLE-3 rule",
                 "'fc.weight': shape", "'t2d' disagrees with 'd2t'"):
        assert part in msg, msg
    with pytest.raises(ValueError, match="outside the target's 2 layers"):
        Engine.from_model(model, ByteTokenizer(), **ENGINE_KW,
                          speculative=Eagle3Config(str(tmp_path), aux_layer_ids=(0, 1, 5)))
    with pytest.raises(FileNotFoundError):
        Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(str(tmp_path / "nope")))
    for bad in (dict(k=0), dict(k=2.0), dict(verification="maybe"), dict(aux_layer_ids=(1, 2)), dict(min_confidence=1.5),
                dict(min_confidence=-0.1)):
        with pytest.raises(ValueError):
            Eagle3Config(str(tmp_path), **bad)


# ---- drafts equal the numpy reference ---------------------------------------------------------------

@pytest.mark.parametrize("verify_steps", [1, 8])
def test_engine_drafts_match_numpy_reference(model, trained_head_dir, verify_steps: int) -> None:
    """Every draft of a batched generation (prefill, decode, verification with rejections, chunked
    prompts; one or several draft-verify steps per device call) equals the numpy head over the
    sequence's history."""
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, auto_disable=False, min_confidence=0.0, num_verify_steps=verify_steps))
    log = record_drafts(engine)
    prompts = prompts_for(5, 5) + [rand_prompt(np.random.default_rng(6), 80)]  # 80 tokens: a chunked prefill
    engine.generate(prompts, SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True))
    head = engine.runner.drafter.head
    assert len(log) > 20
    rng = np.random.default_rng(0)
    for i in rng.choice(len(log), 12, replace=False):
        history, drafts = log[i]
        assert drafts == reference_drafts(head, model, history, K)[0], (i, len(history))
    s = engine.stats().speculative
    assert 0 < s.accepted_tokens < s.drafted_tokens  # both accepted and rejected drafts happened


@pytest.mark.parametrize("verify_steps", [1, 8])
def test_plain_multi_step_calls_fill_the_head_cache(model, plain: Engine, trained_head_dir, verify_steps: int) -> None:
    """Decode steps that auto-disable takes off drafting run as multi-step calls that fill the head's cache
    after every step: outputs and logprobs stay plain decoding's, and every draft made after such calls
    equals the numpy head over the sequence's history."""
    engine = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, min_confidence=0.0, num_verify_steps=verify_steps))
    decisions = iter(range(10**6))
    engine.core.speculator._worth_it = lambda seqs: next(decisions) % 3 == 0  # draft one decision in three
    log = record_drafts(engine)
    plain_calls: list[int] = []
    def run(batch, result):
        if batch.kind == "decode_loop":
            plain_calls.append(int(np.max(batch.loop.num_steps)))
        return result

    observe_steps(engine.runner, run)
    prompts = prompts_for(9, 6)
    params = [SamplingParams(seed=i, max_tokens=40, ignore_eos=True, temperature=1.0 if i % 2 else 0.0, logprobs=1)
              for i in range(6)]
    assert_same(plain.generate(prompts, params), engine.generate(prompts, params), logprobs=True)
    assert max(plain_calls) > 1  # several plain steps per call ran
    s = engine.stats().speculative
    assert s.num_disabled_steps > 0 and s.num_draft_steps > 0
    head = engine.runner.drafter.head
    assert len(log) > 10
    for i in np.random.default_rng(1).choice(len(log), 10, replace=False):
        history, drafts = log[i]
        assert drafts == reference_drafts(head, model, history, K)[0], (i, len(history))


def test_training_forward_matches_inference(model, trained_head_dir) -> None:
    """`dense_steps` (training-time test) at anchor c - 1 equals the inference steps fed the same tokens."""
    head = load_eagle3_head(trained_head_dir, CFG)
    tokens = prompts_for(9, 1)[0] + [5, 9, 17, 33, 60]
    aux, _, _ = target_features(model, jnp.asarray([tokens]), head.config.aux_layer_ids)
    from runner.spec_decode.eagle3 import dense_steps
    next_ids = jnp.asarray([tokens[1:] + [0]])
    outs = dense_steps(head, model, head.fc(aux), next_ids, jnp.arange(len(tokens))[None], K)
    c = len(tokens) - K - 1
    _, ref = reference_drafts(head, model, tokens[:c + 1], K, forced=tokens[c + 1:c + K])
    for j in range(K):
        np.testing.assert_allclose(np.asarray(outs[j][0, c - 1 + j]), ref[j], rtol=2e-4, atol=2e-4)


# ---- exactness in the engine ----------------------------------------------------------------------

@pytest.mark.parametrize("case", ["greedy", "t1.0", "logprobs_processed"])
def test_eagle_equals_plain(plain: Engine, spec: Engine, case: str) -> None:
    before = spec.stats().speculative
    for batch_size in (1, 8, 32):
        prompts = prompts_for(200 + batch_size, batch_size)
        params = [SamplingParams(seed=i, max_tokens=24, ignore_eos=True, **CASES[case]) for i in range(batch_size)]
        assert_same(plain.generate(prompts, params), spec.generate(prompts, params), logprobs="logprobs" in case)
    after = spec.stats().speculative
    assert after.accepted_tokens > before.accepted_tokens
    assert after.num_disabled_steps == 0


def test_eagle_with_preemption_and_rejection_mode(model, plain: Engine, trained_head_dir) -> None:
    small = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, kv_cache_blocks=MAX_LEN // 16,
                              speculative=Eagle3Config(trained_head_dir, k=K, auto_disable=False))
    prompts = prompts_for(11, 6)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=48, logprobs=2, ignore_eos=True)
    assert_same(plain.generate(prompts, sp), small.generate(prompts, sp), logprobs=True)
    assert small.stats().num_preemptions > 0 and small.stats().speculative.accepted_tokens > 0
    rejection = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, auto_disable=False, verification="rejection"))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    assert_same(plain.generate(prompts, greedy), rejection.generate(prompts, greedy), logprobs=True)
    assert rejection.stats().speculative.accepted_tokens > 0


@pytest.fixture(scope="module")
def spec_steps(model, trained_head_dir) -> Engine:
    return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, auto_disable=False, num_verify_steps=4))


@pytest.mark.parametrize("case", ["greedy", "t1.0", "logprobs_processed"])
def test_multi_step_verification_equals_plain(plain: Engine, spec_steps: Engine, case: str) -> None:
    """Up to 4 draft-verify steps per device call (acceptance on the device): plain decoding's tokens and
    logprobs, at batch sizes 1, 8 and 32 (queued through 8 slots), with uneven `max_tokens`."""
    before = spec_steps.stats()
    for batch_size in (1, 8, 32):
        prompts = prompts_for(500 + batch_size, batch_size)
        params = [SamplingParams(seed=i, max_tokens=21 + i % 7, ignore_eos=True, **CASES[case])
                  for i in range(batch_size)]
        assert_same(plain.generate(prompts, params), spec_steps.generate(prompts, params), logprobs="logprobs" in case)
    after = spec_steps.stats()
    assert after.speculative.accepted_tokens > before.speculative.accepted_tokens
    # several verification steps per device call
    calls = after.num_decode_steps - before.num_decode_steps
    assert after.speculative.num_draft_steps - before.speculative.num_draft_steps > 1.5 * calls


def test_multi_step_verification_stops_and_preemption(model, plain: Engine, trained_head_dir) -> None:
    """Stop ids sampled inside the device loop end the sequence there (min_tokens first suppresses them),
    EOS counts unless ignored, and a KV cache too small for the batch (preemption) changes nothing; on
    the pure-JAX attention path (accelerators; its cascade over pages common to all sequences)."""
    prompts = prompts_for(600, 6)
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    runs = plain.generate(prompts, free)
    stops = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, min_tokens=4,
                            stop_token_ids=[r.outputs[0].token_ids[2], r.outputs[0].token_ids[9]])
             for i, r in enumerate(runs)]
    small = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, kv_cache_blocks=MAX_LEN // 16, attention_backend="jax",
                              speculative=Eagle3Config(trained_head_dir, k=K, auto_disable=False, num_verify_steps=4))
    one = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    assert_same(plain.generate(prompts[:1], one), small.generate(prompts[:1], one))  # B=1: all pages common
    expected = plain.generate(prompts, stops)
    assert any(o.outputs[0].finish_reason == "stop" for o in expected)
    assert_same(expected, small.generate(prompts, stops))
    long = [dataclasses.replace(p, max_tokens=60, ignore_eos=True) for p in free]
    assert_same(plain.generate(prompts, long), small.generate(prompts, long))
    assert small.stats().num_preemptions > 0 and small.stats().speculative.accepted_tokens > 0


def test_trained_head_accepts_more_than_random(model, random_head_dir, spec: Engine) -> None:
    prompts = prompts_for(300, 8)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rand = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW,
                             speculative=Eagle3Config(random_head_dir, k=K, auto_disable=False))
    rand.generate(prompts, sp)
    before = spec.stats().speculative
    spec.generate(prompts, sp)
    after = spec.stats().speculative
    trained_rate = (after.accepted_tokens - before.accepted_tokens) / (after.drafted_tokens - before.drafted_tokens)
    assert trained_rate > 0.3 and trained_rate > 3 * rand.stats().speculative.acceptance_rate


def test_no_compilation_after_warmup(model, trained_head_dir) -> None:
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(trained_head_dir, k=K))
    e.warmup()
    before = num_compilations()
    e.generate(prompts_for(400, 1), SamplingParams(temperature=0.0, max_tokens=12))
    e.generate(prompts_for(401, 13), SamplingParams(temperature=1.0, seed=1, logprobs=2, max_tokens=12))
    assert num_compilations() - before == 0
    assert e.stats().speculative.num_draft_steps > 0


def test_a_second_engine_loads_the_draft_programs(model, random_head_dir, tmp_path) -> None:
    """The head's fill and draft-verify programs go through the executable store like the target's: an
    engine built as in a new process (the store's memory dropped) loads every one and drafts the same."""
    from runner import executable_store

    def build() -> Engine:
        executable_store.open_store.cache_clear()
        return Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, compilation_cache_dir=str(tmp_path),
                                 speculative=Eagle3Config(random_head_dir, k=K, auto_disable=False))

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = build()
    want = [o.outputs[0].token_ids for o in first.generate(prompts_for(500, 3), sp)]
    assert first.runner.num_loaded_programs == 0 and first.stats().speculative.num_draft_steps > 0
    stored = len(list((tmp_path / "executables").glob("*.exe")))
    assert stored >= 3  # prefill, a fill, a draft-verify program at least
    again = build()
    assert [o.outputs[0].token_ids for o in again.generate(prompts_for(500, 3), sp)] == want
    assert again.runner.num_loaded_programs == stored and again.runner.drafter.num_loaded >= 2


# ---- weight sync ----------------------------------------------------------------------------------

def test_sync_weights_policy_and_draft_head(model, plain: Engine, trained_head_dir, random_head_dir) -> None:
    """One call syncs the policy and new head weights (published layout); drafts then follow both
    (the numpy reference with the new policy's embedding and the new head), outputs equal plain."""
    a = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW)
    b = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW,
                          speculative=Eagle3Config(random_head_dir, k=K, auto_disable=False, min_confidence=0.0))
    prompts = prompts_for(500, 4)
    sp = SamplingParams(temperature=1.0, seed=9, max_tokens=24, logprobs=1, ignore_eos=True)
    b.generate(prompts, sp)
    rng = np.random.default_rng(1)
    other = make_model()
    state = nnx.state(other, nnx.Param)
    nnx.update(other, jax.tree.map(lambda x: x + jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), state))
    from safetensors.numpy import load_file
    published = load_file(os.path.join(trained_head_dir, "model.safetensors"))
    with pytest.raises(Exception, match="lm_head"):  # the random head shares the lm_head: no such target
        b.sync_weights(nnx.state(other, nnx.Param), draft_params=published, draft_mapping="eagle3-hf")
    assert b.policy_version is None  # nothing applied
    shared = init_eagle3_head(other, seed=7)
    published = _published(shared)
    abstract = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in published.items()}
    with pytest.raises(WeightSyncError, match="ShapeDtypeStruct"):  # the head's tree fails after the policy's plan
        b.sync_weights(nnx.state(other, nnx.Param), draft_params=abstract, draft_mapping="eagle3-hf")
    assert b.policy_version is None
    for ours, before in zip(jax.tree.leaves(b.runner.params), jax.tree.leaves(nnx.state(model, nnx.Param))):
        assert np.array_equal(np.asarray(ours), np.asarray(before))  # the policy's weights untouched
    a.sync_weights(nnx.state(other, nnx.Param))
    b.sync_weights(nnx.state(other, nnx.Param), draft_params=published, draft_mapping="eagle3-hf")
    log = record_drafts(b)
    assert_same(a.generate(prompts, sp), b.generate(prompts, sp), logprobs=True)
    head = b.runner.drafter.head
    assert np.array_equal(np.asarray(head.fc.kernel[...]), np.asarray(shared.fc.kernel[...]))
    assert len(log) >= 6
    for history, drafts in log[:6]:
        assert drafts == reference_drafts(shared, other, history, K)[0]
    with pytest.raises(ValueError, match="no EAGLE-3 head"):
        a.sync_weights(nnx.state(other, nnx.Param), draft_params=published, draft_mapping="eagle3-hf")


def _published(head: Eagle3Head) -> dict[str, np.ndarray]:
    import tempfile

    from safetensors.numpy import load_file
    with tempfile.TemporaryDirectory() as d:
        save_eagle3_head(head, d)
        return dict(load_file(os.path.join(d, "model.safetensors")))


def test_stats_and_auto_disable(model, random_head_dir) -> None:
    # one verification step per call: on a tiny model a multi-step verification call costs about what a
    # multi-step plain call does, so a random head's ~1 token per step could tie with plain decoding
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW,
                          speculative=Eagle3Config(random_head_dir, k=K, min_confidence=0.0, num_verify_steps=1))
    e.generate(prompts_for(600, 8), SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True))
    s = e.stats().speculative
    assert s.num_draft_steps > 0 and s.num_disabled_steps > 0  # a random head does not pay: it turns off
    assert s.drafted_tokens > 0 and s.mean_accepted_per_step >= 1.0
    assert dataclasses.asdict(s)["acceptance_by_version"][None][0] == s.drafted_tokens


def test_soft_label_loss_and_fixed_lm_head(model) -> None:
    """The training script's loss: soft targets are the target's distribution over the draft vocabulary
    (checked by hand at one position), and `train_lm_head=False` leaves no gradient on the lm_head."""
    head = init_eagle3_head(model, draft_vocab_ids=DRAFT_VOCAB, seed=2)
    tokens = jnp.asarray(prompts_for(700, 1)[0][:12])[None]
    mask = jnp.ones(tokens.shape, jnp.float32)
    aux, labels, hidden = target_features(model, tokens, head.config.aux_layer_ids)
    t2d = jnp.asarray(target_to_draft(head))
    loss_fn = lambda h: eagle3_loss(h, model, aux, tokens, labels, mask, t2d, 1, target_hidden=hidden,  # noqa: E731
                                    train_lm_head=False)[0]
    loss, grads = nnx.value_and_grad(loss_fn)(head)
    assert np.isfinite(float(loss))
    assert float(jnp.abs(grads.lm_head.kernel[...]).max()) == 0.0
    assert float(jnp.abs(grads.fc.kernel[...]).max()) > 0.0
    # by hand: position 0 of step 0 predicts the target's distribution at position 1 over the draft ids
    from runner.spec_decode.eagle3 import dense_steps
    x = dense_steps(head, model, head.fc(aux), jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))),
                    jnp.arange(tokens.shape[1])[None], 1)[0]
    logp = jax.nn.log_softmax(head.logits(model, x)[0], axis=-1)
    target_logits = np.asarray(model.compute_logits(hidden)[0])[:, DRAFT_VOCAB]
    p = np.exp(target_logits - target_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ce = -(p[1:] * np.asarray(logp[:-1])).sum(-1)  # positions 0..S-2 ...
    counted = np.asarray(t2d)[np.asarray(labels[0, 1:])] >= 0  # ... whose greedy label the draft vocab has
    assert 0 < counted.sum() < len(counted)
    np.testing.assert_allclose(float(loss), ce[counted].mean(), rtol=1e-4)


# ---- drafts made on the device take the places the host path gives them -------------------------

@pytest.mark.parametrize("num_replicas", [1, 2])
def test_place_drafts_matches_host_built_verification(num_replicas: int) -> None:
    """Tokens and rejection `draft_ids` of a verification step whose drafts the device fills equal those
    of the same step built on the host with the drafts known (sequences with 0..K drafts, two replicas)."""
    from rollout.scheduler import ScheduledBatch
    from rollout.sequence import Sequence
    from rollout.plan_builder import build_plan
    from runner.buckets import BucketConfig
    from runner.spec_decode.eagle3_programs import place_drafts
    from runner.step_padding import pad_plan, verify_shape

    rng = np.random.default_rng(0)
    seqs = []
    for i, n in enumerate([5, 17, 9, 30]):
        seq = Sequence(i, i, 0, rng.integers(0, 90, n).tolist(), SamplingParams(temperature=1.0, max_tokens=20), i, i)
        seq.num_computed_tokens, seq.replica = n - 1, i % num_replicas
        seq.block_table = [100 * seq.replica + b for b in range(3)]
        seqs.append(seq)
    batch = ScheduledBatch("decode_loop", seqs, [1] * len(seqs))
    limits = [K, 0, 1, K - 1]
    drafts = rng.integers(0, 90, (len(seqs), K)).astype(np.int32)  # what the head made, per sequence
    known = build_plan(batch, (), [d[:n] for d, n in zip(drafts, limits)], rejection=True)
    placeholders = build_plan(batch, (), [np.full(n, -1, np.int32) for n in limits], rejection=True,
                              device_drafts=True)
    buckets = BucketConfig(8, 64, 8, verify_rows=K + 1)
    want, _ = pad_plan(known, verify_shape, buckets, 16, num_replicas, 100)
    padded, layout = pad_plan(placeholders, verify_shape, buckets, 16, num_replicas, 100)
    rows = padded.md.page_indices.shape[1]
    per_row = np.zeros((num_replicas * rows, K), np.int32)
    per_row[layout.seq_index] = drafts  # the device's drafts sit at each sequence's attention row
    got = place_drafts(jax.tree.map(jnp.asarray, padded), jnp.asarray(per_row.reshape(num_replicas, rows, K)))
    np.testing.assert_array_equal(np.asarray(got.token_ids), want.token_ids)
    np.testing.assert_array_equal(np.asarray(got.sampling.draft_ids), want.sampling.draft_ids)
    assert (placeholders.tokens.token_ids == -1).sum() == sum(limits)  # the host really left them to the device


def test_unsure_head_decodes_plainly(model, plain: Engine, trained_head_dir) -> None:
    """`min_confidence`: steps where every first draft is below it decode plainly inside the verification
    program. Outputs and logprobs equal plain decoding at batch sizes 1 and 8, drafts of later steps
    still equal the numpy head (the plain branch fills the head's cache), and once the greedy case has
    compiled its steps, sampling at T=1 (sure and unsure steps alike) compiles nothing (the whole
    warmup is `test_no_compilation_after_warmup`'s); under rejection sampling with min_confidence=1.0
    (nearly every step plain) greedy is exact."""
    e = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, auto_disable=False, min_confidence=0.6))
    log = record_drafts(e)
    for case in ("greedy", "t1.0", "logprobs_processed"):
        for batch_size in (1, 8):
            prompts = prompts_for(700 + batch_size, batch_size)
            params = [SamplingParams(seed=i, max_tokens=24, ignore_eos=True, **CASES[case]) for i in range(batch_size)]
            expected = plain.generate(prompts, params)
            before = num_compilations()
            assert_same(expected, e.generate(prompts, params), logprobs="logprobs" in case)
            assert case != "t1.0" or num_compilations() == before, batch_size
    s = e.stats().speculative
    assert 0 < s.num_unsure_steps < s.num_draft_steps and s.accepted_tokens > 0, s
    assert len(log) >= 6
    head = e.runner.drafter.head
    for history, drafts in log[-6:]:  # late verified steps: their histories went through unsure steps
        assert drafts == reference_drafts(head, model, history, K)[0]
    rejection = Engine.from_model(model, ByteTokenizer(), **ENGINE_KW, speculative=Eagle3Config(
        trained_head_dir, k=K, auto_disable=False, verification="rejection", min_confidence=1.0))
    prompts = prompts_for(11, 6)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    assert_same(plain.generate(prompts, greedy), rejection.generate(prompts, greedy), logprobs=True)
    s = rejection.stats().speculative
    assert s.num_unsure_steps >= 0.9 * s.num_draft_steps, s  # a float32 probability of exactly 1.0 verifies
