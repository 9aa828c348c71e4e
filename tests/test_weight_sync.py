"""weight_sync: presets round trips, fused splits, cross-mesh resharding, atomic failure, memory, LoRA."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import weight_sync as ws
from runner.models.config import ModelConfig
from runner.models.llama import LlamaForCausalLM
from runner.models.registry import config_from_hf

FAMILIES = {
    "llama": dict(),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
}


def make_cfg(family: str = "llama", tie: bool = False, **kw: object) -> ModelConfig:
    base = dict(family=family, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie)
    base.update(FAMILIES[family])
    base.update(kw)
    return ModelConfig(**base)


def make_model(cfg: ModelConfig, seed: int = 0, randomize: bool = False) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))
    if randomize:  # every parameter (norm scales and biases included) gets distinct values
        rng = np.random.default_rng(seed + 100)
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            x = var.get_value()
            noise = rng.normal(0, 0.05, x.shape).astype(np.float32)
            var.set_value(jnp.asarray(np.asarray(x, np.float32) + noise, x.dtype))
    return model


def params(model: LlamaForCausalLM) -> nnx.State:
    return nnx.state(model, nnx.Param)


def flat(tree: object) -> dict[str, np.ndarray]:
    f = ws.flatten(tree)
    return {p: np.asarray(x) for p, x in zip(f.paths, f.leaves)}


def to_hf(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The engine's params under HF names and PyTorch `[out, in]` layouts (written independently of the preset)."""
    out: dict[str, np.ndarray] = {}
    for path, x in flat(params(model)).items():
        if path == "embed_tokens":
            out["model.embed_tokens.weight"] = x
        elif path == "lm_head.kernel":
            out["lm_head.weight"] = x.T.copy()
        elif path == "norm.scale":
            out["model.norm.weight"] = x
        elif path.endswith(".scale"):
            out["model." + path.removesuffix(".scale") + ".weight"] = x
        elif path.endswith(".kernel"):
            out["model." + path.removesuffix(".kernel") + ".weight"] = x.T.copy()
        else:
            out["model." + path] = x
    return out


def logits(model: LlamaForCausalLM) -> np.ndarray:
    ids = jnp.array([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 11, 6]])
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return np.asarray(model(ids, pos))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_preset_round_trip(family: str, tie: bool) -> None:
    cfg = make_cfg(family, tie)
    trained, engine = make_model(cfg, 1, randomize=True), make_model(cfg, 0)
    src = to_hf(trained)
    state = params(engine)
    plan = ws.plan(src, state, "hf")
    assert ws.apply(plan, src, state) is state
    nnx.update(engine, state)
    np.testing.assert_allclose(logits(engine), logits(trained), atol=1e-6, rtol=0)
    # a plan needs only shapes and dtypes, and is cached by structure
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in src.items()}
    p2 = ws.plan(abstract, state, "hf")
    assert p2.fingerprint == plan.fingerprint and p2 is plan


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_names_match_transformers(family: str, tie: bool) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[family]
    hf_cfg = cls_cfg(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tie)
    hf_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM}[family]
    torch.manual_seed(0)
    hf_model = hf_cls(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in hf_model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.05)
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    cfg = config_from_hf(hf_cfg.to_dict())
    engine = make_model(cfg)
    ours = set(to_hf(engine))
    assert set(sd) - {"lm_head.weight"} == ours - {"lm_head.weight"}
    assert ("lm_head.weight" in ours) == (not tie)
    state = params(engine)
    ws.apply(ws.plan(sd, state, "hf"), sd, state)
    nnx.update(engine, state)
    ids = np.array([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    got = np.asarray(engine(jnp.asarray(ids), jnp.arange(6)[None]))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
    if tie:  # the strict preset refuses the tied lm_head.weight
        with pytest.raises(ws.WeightSyncError, match="lm_head.weight"):
            ws.plan(sd, state, "hf-strict")


def test_identity_and_linen_sources() -> None:
    cfg = make_cfg("qwen3")
    trained, engine = make_model(cfg, 1, randomize=True), make_model(cfg, 0)
    for src in (params(trained), {"params": nnx.to_pure_dict(params(trained))}):
        engine = make_model(cfg, 0)
        state = params(engine)
        ws.apply(ws.plan(src, state, None), src, state)
        np.testing.assert_allclose(logits(engine), logits(trained), atol=1e-6, rtol=0)
    # the source is copied, never aliased: the trainer may delete its buffers afterwards
    src = params(trained)
    state = params(make_model(cfg, 0))
    ws.apply(ws.plan(src, state, "identity"), src, state)
    want = flat(state)
    for x in jax.tree.leaves(src):
        x.delete()
    assert all(np.array_equal(flat(state)[k], v) for k, v in want.items())


def fuse(src: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    out = dict(src)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[f"{a}.qkv_proj.{kind}"] = np.concatenate([out.pop(f"{a}.{n}_proj.{kind}") for n in "qkv"], axis=0)
        out[f"{m}.gate_up_proj.weight"] = np.concatenate([out.pop(f"{m}.gate_proj.weight"),
                                                          out.pop(f"{m}.up_proj.weight")], axis=0)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_source_split_rules(family: str) -> None:
    cfg = make_cfg(family)
    trained, engine = make_model(cfg, 1, randomize=True), make_model(cfg, 0)
    src = {k: jnp.asarray(v) for k, v in fuse(to_hf(trained), cfg).items()}  # device arrays this time
    state = params(engine)
    ws.apply(ws.plan(src, state, "hf-fused"), src, state)
    np.testing.assert_allclose(logits(engine), logits(trained), atol=1e-6, rtol=0)

    # a JAX-layout trainer with a fused [H, q|k|v] kernel, explicit split sizes
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv_rule = ws.Rule("layers.*.attn.qkv.kernel", tuple(f"layers.*.self_attn.{n}_proj.kernel" for n in "qkv"),
                       split=ws.Split(axis=1, sizes=(q, kv, kv)))
    tp = flat(params(trained))
    jsrc = {k: v for k, v in tp.items() if ".self_attn.q_proj" not in k and ".self_attn.k_proj" not in k
            and ".self_attn.v_proj" not in k}
    for i in range(cfg.num_hidden_layers):
        parts = [tp[f"layers.{i}.self_attn.{n}_proj.kernel"] for n in "qkv"]
        jsrc[f"layers.{i}.attn.qkv.kernel"] = np.concatenate(parts, axis=1)
        if cfg.qkv_bias:
            jsrc[f"layers.{i}.attn.qkv.bias"] = np.concatenate(
                [tp[f"layers.{i}.self_attn.{n}_proj.bias"] for n in "qkv"])
    rules = (qkv_rule, ws.Rule("layers.*.attn.qkv.bias", tuple(f"layers.*.self_attn.{n}_proj.bias" for n in "qkv"),
                               split=ws.Split(axis=0))) + ws.identity()
    engine = make_model(cfg, 0)
    state = params(engine)
    ws.apply(ws.plan(jsrc, state, rules), jsrc, state)
    np.testing.assert_allclose(logits(engine), logits(trained), atol=1e-6, rtol=0)
    # wrong split sizes are reported
    bad = (ws.Rule(qkv_rule.source, qkv_rule.target, split=ws.Split(axis=1, sizes=(q, kv, kv + 8))),) + rules[1:]
    with pytest.raises(ws.WeightSyncError, match="split sizes"):
        ws.plan(jsrc, state, bad)


def test_concat_into_fused_target_and_dtype_rules() -> None:
    rng = np.random.default_rng(0)
    src = {f"l.{i}.{n}.weight": rng.normal(size=(d, 8)).astype(np.float32)
           for i in range(2) for n, d in (("q", 8), ("k", 4), ("v", 4))}
    target = {"l": {str(i): {"qkv": jnp.zeros((8, 16), jnp.bfloat16)} for i in range(2)}}
    rules = [ws.Rule(tuple(f"l.*.{n}.weight" for n in "qkv"), "l.*.qkv", concat=0, transpose=(1, 0),
                     dtype="bfloat16")]
    new = ws.apply(ws.plan(src, target, rules), src, target)
    for i in range(2):
        want = np.concatenate([src[f"l.{i}.{n}.weight"] for n in "qkv"], 0).T
        got = new["l"][str(i)]["qkv"]
        assert got.dtype == jnp.bfloat16 and got.shape == (8, 16)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    # a rule dtype that disagrees with the target, a non-float source into a float target, a missing concat part
    target = {"l": {str(i): {"qkv": jnp.zeros((8, 16), jnp.bfloat16)} for i in range(2)}}
    bad_src = dict(src)
    bad_src["l.0.q.weight"] = bad_src["l.0.q.weight"].astype(np.int32)
    del bad_src["l.1.v.weight"]
    rules32 = [ws.Rule(rules[0].source, "l.*.qkv", concat=0, transpose=(1, 0), dtype="float32")]
    with pytest.raises(ws.WeightSyncError) as e:
        ws.plan(bad_src, target, rules32)
    msg = str(e.value)
    assert "rule dtype float32 != target dtype bfloat16" in msg and "cannot cast int32" in msg
    assert "lacks source(s) ['l.1.v.weight']" in msg


def test_stack_per_expert_sources_into_one_target() -> None:
    """`stack=True`: per-expert `[out, in]` tensors -> one `[experts, in, out]` target; shape and
    missing-expert problems are reported by name."""
    rng = np.random.default_rng(1)
    src = {f"l.{i}.e.{x}.w": rng.normal(size=(6, 4)).astype(np.float32) for i in range(2) for x in range(3)}
    target = {"l": {str(i): {"w": jnp.zeros((3, 4, 6), jnp.float32)} for i in range(2)}}
    rule = ws.Rule(tuple(f"l.*.e.{x}.w" for x in range(3)), "l.*.w", concat=0, stack=True, transpose=(0, 2, 1))
    new = ws.apply(ws.plan(src, target, [rule]), src, target)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(new["l"][str(i)]["w"]),
                                      np.stack([src[f"l.{i}.e.{x}.w"].T for x in range(3)]))
    bad = dict(src)
    del bad["l.1.e.2.w"]
    bad["l.0.e.1.w"] = np.zeros((5, 4), np.float32)
    with pytest.raises(ws.WeightSyncError) as e:
        ws.plan(bad, target, [rule])
    msg = str(e.value)
    assert "stack rule" in msg and "lacks source(s) ['l.1.e.2.w']" in msg and "cannot stack shapes" in msg
    with pytest.raises(ValueError, match="needs `concat=axis`"):
        ws.Rule(("a", "b"), "c", stack=True)


def test_failure_is_atomic() -> None:
    cfg = make_cfg("qwen2")
    trained, engine = make_model(cfg, 1, randomize=True), make_model(cfg, 0)
    state = params(engine)
    before = flat(state)
    src = to_hf(trained)
    del src["model.layers.1.mlp.up_proj.weight"]  # missing
    src["model.layers.0.mlp.extra.weight"] = np.zeros((4, 4), np.float32)  # no row of the family's name table
    src["model.layers.9.bogus"] = np.zeros((4,), np.float32)  # unmapped
    src["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)  # wrong shape
    src["model.layers.0.self_attn.v_proj.bias"] = np.zeros((16,), np.int32)  # non-float into float
    with pytest.raises(ws.WeightSyncError) as e:
        ws.plan(src, state, "hf")
    err = e.value
    assert isinstance(err, ValueError) and len(err.problems) == 5, err
    msg = str(err)
    for needle in ("'layers.1.mlp.up_proj.kernel' [32, 64] is not filled", "model.layers.9.bogus' [4] matches no rule",
                   "'model.layers.0.mlp.extra.weight' [4, 4] matches no rule", "shape [32, 8] after transform != target [32, 16]",
                   "cannot cast int32 to float32"):
        assert needle in msg, msg
    # NaN / Inf with check_finite: all offenders in one error, nothing changed
    src = to_hf(trained)
    src["model.layers.0.mlp.up_proj.weight"][0, 0] = np.nan
    src["lm_head.weight"] = jnp.asarray(src["lm_head.weight"]).at[3, 3].set(jnp.inf)
    plan = ws.plan(src, state, "hf")
    with pytest.raises(ws.WeightSyncError) as e:
        ws.apply(plan, src, state, check_finite=True)
    assert len(e.value.problems) == 2 and "up_proj.weight" in str(e.value) and "lm_head.weight" in str(e.value)
    # a plan used with a tree of another structure
    with pytest.raises(ws.WeightSyncError, match="differs"):
        ws.apply(plan, {k: v for k, v in src.items() if "lm_head" not in k}, state)
    # duplicate targets
    rules = ws.resolve("hf") + (ws.Rule("extra.q", "layers.0.self_attn.q_proj.kernel"),)
    with pytest.raises(ws.WeightSyncError, match="filled 2 times"):
        ws.plan({**to_hf(trained), "extra.q": np.zeros((32, 32), np.float32)}, state, rules)
    after = flat(state)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def _tp_spec(path: str, ndim: int) -> P:
    if path.endswith(("q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "gate_proj.kernel", "up_proj.kernel",
                      "lm_head.kernel")) or path == "embed_tokens":
        return P(None, "model")
    if path.endswith(("o_proj.kernel", "down_proj.kernel")):
        return P("model", None)
    return P()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cross_mesh_resharding(tp: int) -> None:
    devices = jax.devices()
    assert len(devices) == 8
    src_mesh = Mesh(np.array(devices), ("fsdp",))
    tgt_mesh = Mesh(np.array(devices[8 - tp:]), ("model",))
    cfg = make_cfg("qwen2")
    engine = make_model(cfg, 0)
    state = params(engine)
    for path, var in nnx.to_flat_state(state):
        p = ".".join(map(str, path))
        var.set_value(jax.device_put(var.get_value(), NamedSharding(tgt_mesh, _tp_spec(p, var.get_value().ndim))))
    shardings = {p: x.sharding for p, x in zip(ws.flatten(state).paths, ws.flatten(state).leaves)}

    def source(seed: int) -> dict[str, jax.Array]:
        hf = to_hf(make_model(cfg, seed, randomize=True))
        return {k: jax.device_put(v, NamedSharding(src_mesh, P("fsdp") if v.shape[0] % 8 == 0 else P()))
                for k, v in hf.items()}

    a, b = source(1), source(2)
    ws.apply(ws.plan(a, state, "hf"), a, state)  # warm-up: compiles the transposes once
    with ws.CompileCounter() as cc:
        plan = ws.plan(b, state, "hf")
        ws.apply(plan, b, state)
        ws.apply(plan, a, state)
    assert cc.count == 0
    got = flat(state)
    want = flat(params(make_model(cfg, 1, randomize=True)))
    assert all(np.array_equal(got[k], want[k]) for k in want)
    f = ws.flatten(state)
    assert {p: x.sharding for p, x in zip(f.paths, f.leaves)} == shardings
    assert all(not x.is_deleted() for x in a.values())  # the source is untouched


def _live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def test_memory_flat_over_many_syncs() -> None:
    cfg = make_cfg("llama")
    engine = make_model(cfg, 0)
    state = params(engine)
    srcs = [{k: jnp.asarray(v) for k, v in to_hf(make_model(cfg, s, randomize=True)).items()} for s in (1, 2)]
    plan = ws.plan(srcs[0], state, "hf")
    largest = max(x.nbytes for x in jax.tree.leaves(state))
    peak = [0]
    base = _live_bytes()

    def sample(_: str) -> None:
        peak[0] = max(peak[0], sum(x.nbytes for x in jax.live_arrays()))

    seen: dict[int, int] = {}
    for i in range(1, 51):
        ws.apply(plan, srcs[i % 2], state, on_tensor=sample if i in (10, 50) else None)
        if i in (10, 50):
            seen[i] = _live_bytes()
    assert abs(seen[50] - seen[10]) <= largest and abs(seen[10] - base) <= largest
    assert peak[0] - seen[50] <= 1.01 * largest  # at most one tensor in flight
    want = flat(params(make_model(cfg, 1, randomize=True)))  # sync 50 used srcs[0] (seed 1)
    got = flat(state)
    assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("layout", ["jax", "peft"])
def test_lora_merge(layout: str) -> None:
    cfg = make_cfg("llama")
    engine, ref = make_model(cfg, 0), make_model(cfg, 0)
    rng = np.random.default_rng(3)
    r, scale, lora = 4, 0.5, {}
    ref_state = params(ref)
    for i in range(cfg.num_hidden_layers):
        for mod in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            kernel = ref_state["layers"][i]
            for part in mod.split("."):
                kernel = kernel[part]
            kernel = kernel["kernel"]
            d_in, d_out = kernel.get_value().shape
            a = rng.normal(0, 0.1, (d_in, r)).astype(np.float32)
            b = rng.normal(0, 0.1, (r, d_out)).astype(np.float32)
            kernel.set_value(kernel.get_value() + scale * jnp.asarray(a @ b))
            if layout == "jax":
                lora[f"layers.{i}.{mod}.lora_A"], lora[f"layers.{i}.{mod}.lora_B"] = a, b
            else:
                lora[f"base_model.model.model.layers.{i}.{mod}.lora_A.weight"] = a.T.copy()
                lora[f"base_model.model.model.layers.{i}.{mod}.lora_B.weight"] = b.T.copy()
    state = params(engine)
    ws.merge_lora(lora, state, scale=scale, layout=layout)
    np.testing.assert_allclose(logits(engine), logits(ref), atol=1e-5, rtol=1e-5)
    # validation: a lone A, a wrong rank, an unknown module -> one error, nothing changed
    before = flat(state)
    bad = dict(list(lora.items())[:4])
    k = next(iter(bad))
    bad[k] = np.zeros((3, 3), np.float32)
    bad[k.replace("q_proj", "nope_proj")] = np.zeros((4, 4), np.float32)
    bad[k.replace("q_proj", "nope_proj").replace("lora_A", "lora_B")] = np.zeros((4, 4), np.float32)
    bad[k.replace("layers.0", "layers.1").replace("q_proj", "k_proj")] = np.zeros((4, 4), np.float32)
    with pytest.raises(ws.WeightSyncError) as e:
        ws.merge_lora(bad, state, scale=scale, layout=layout)
    assert len(e.value.problems) == 3, e.value
    after = flat(state)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    if layout != "peft":
        return
    # two adapters on one module (PEFT names them: lora_A.default, lora_A.other): refused, not half merged
    a_key = next(k for k in lora if "lora_A" in k)
    named = lambda key, name: key.replace("lora_A", f"lora_A.{name}").replace("lora_B", f"lora_B.{name}")  # noqa: E731
    pair = {k: v for k, v in lora.items() if k.rsplit("lora_", 1)[0] == a_key.rsplit("lora_", 1)[0]}
    two = {named(k, name): v for name in ("default", "other") for k, v in pair.items()}
    with pytest.raises(ws.WeightSyncError, match="several A matrices"):
        ws.merge_lora(two, state, scale=scale, layout=layout)
    assert all(np.array_equal(before[k], v) for k, v in flat(state).items())


def test_takes_expand_a_source_into_padded_or_replicated_columns() -> None:
    """`takes` (the engine's attention heads padded / replicated for a mesh): host and device sources
    land in the expanded columns, zeros where the index is -1; a target-shaped source is copied as is,
    and a source that fits neither is refused with the reason."""
    w = np.arange(12, dtype=np.float32).reshape(2, 6)
    index = (0, 1, 2, 3, -1, -1, 4, 5, 4, 5)  # columns 0-3, two zero columns, 4-5 twice
    want = np.concatenate([w[:, :4], np.zeros((2, 2), np.float32), w[:, 4:], w[:, 4:]], axis=1)
    for source in (w, jnp.asarray(w)):
        target = {"w": jnp.zeros((2, 10), jnp.float32)}
        plan = ws.plan({"w": source}, target, "identity", takes={"w": (1, index)})
        out = ws.apply(plan, {"w": source}, target)
        np.testing.assert_array_equal(np.asarray(out["w"]), want)
    same = ws.apply(ws.plan({"w": want}, target, "identity", takes={"w": (1, index)}), {"w": want}, target)
    np.testing.assert_array_equal(np.asarray(same["w"]), want)
    with pytest.raises(ws.WeightSyncError, match="nor expands to it"):
        ws.plan({"w": np.zeros((2, 5), np.float32)}, target, "identity", takes={"w": (1, index)})
    with pytest.raises(ws.WeightSyncError, match=r"shape \[2, 6\] after transform != target \[2, 10\]$"):
        ws.plan({"w": w}, target, "identity")
