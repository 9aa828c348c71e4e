"""The engine on a device mesh: tensor / data parallel outputs equal the single-device run."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams
from runner.models.config import ModelConfig
from runner.models.llama import LlamaForCausalLM
from runner.sharding import make_mesh

from multihost_common import IdTokenizer

CFG = ModelConfig(family="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=8, qkv_bias=True)
KW = dict(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=64, block_size=8)


@pytest.fixture(scope="module")
def setup() -> tuple[LlamaForCausalLM, list[list[int]], list]:
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size=int(n)).tolist() for n in rng.integers(3, 40, size=6)]
    ref = Engine.from_model(model, IdTokenizer(), **KW).generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=0))
    return model, prompts, ref


def assert_same_as_single_device(outs: list, ref: list) -> None:
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = np.array([t.logprob for t in a.outputs[0].logprobs])
        lp_b = np.array([t.logprob for t in b.outputs[0].logprobs])
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)


@pytest.mark.parametrize("mesh", [(1, 4), (2, 2), (8, 1)], ids=str)
def test_mesh_outputs_equal_single_device(setup: tuple, mesh: tuple[int, int]) -> None:
    model, prompts, ref = setup
    engine = Engine.from_model(model, IdTokenizer(), mesh=mesh, **KW)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=0))
    assert_same_as_single_device(outs, ref)


def test_multi_step_decode_on_a_mesh_equals_single_device(setup: tuple) -> None:
    """Multi-step decode with data (vmapped replicas) and tensor parallelism at once."""
    model, prompts, ref = setup
    engine = Engine.from_model(model, IdTokenizer(), mesh=(2, 2), **KW, num_scheduler_steps=5)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=0))
    assert_same_as_single_device(outs, ref)
    assert engine.stats().num_decode_steps <= 3 * 2  # 11 decode tokens in chunks of <= 5, per replica


def test_tensor_parallel_memory_is_a_quarter(setup: tuple) -> None:
    model = setup[0]
    engine = Engine.from_model(model, IdTokenizer(), mesh=(1, 4), **KW)
    leaves = jax.tree.leaves(engine.runner.params)
    total = sum(x.nbytes for x in leaves)
    device = engine.runner.mesh.devices.flat[0]
    on_one = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    assert on_one < 0.3 * total, (on_one, total)
    kv = engine.runner.kv_caches[0]
    kv_one = sum(s.data.nbytes for s in kv.addressable_shards if s.device == device)
    assert kv_one == kv.nbytes // 4  # 4 KV heads over 4 devices


def test_data_parallel_replicas_own_their_kv_blocks(setup: tuple) -> None:
    """(4, 1): each device holds a quarter of the KV cache (its replica's blocks), and a KV
    cache small enough to force preemption inside replicas still gives the single-device outputs."""
    model, prompts, ref = setup
    engine = Engine.from_model(model, IdTokenizer(), mesh=(4, 1), **{**KW, "kv_cache_blocks": 12})
    kv = engine.runner.kv_caches[0]
    assert kv.shape[0] == 4 and kv.shape[3] == 12
    device = engine.runner.mesh.devices.flat[0]
    assert sum(s.data.nbytes for s in kv.addressable_shards if s.device == device) == kv.nbytes // 4
    many = prompts * 3
    outs = engine.generate(many, SamplingParams(temperature=0, max_tokens=12, logprobs=0))
    assert engine.stats().num_preemptions > 0
    kv = engine.runner.kv_caches[0]  # the steps hand the cache back in its own layout
    assert sum(s.data.nbytes for s in kv.addressable_shards if s.device == device) == kv.nbytes // 4
    for a, b in zip(outs, ref * 3):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([t.logprob for t in a.outputs[0].logprobs],
                                   [t.logprob for t in b.outputs[0].logprobs], atol=1e-5)


def test_bad_mesh_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh((8, 8))


def test_load_places_each_tensor_sharded(tmp_path) -> None:
    from helpers_models import hf_config, random_tensors, write_hf_dir

    from runner.models.loader import load_model

    hf = hf_config("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)
    path = write_hf_dir(tmp_path / "ckpt", hf, random_tensors(hf))
    mesh = make_mesh((1, 4))
    model, _ = load_model(str(path), mesh=mesh)
    kernel = model.layers[0].mlp.gate_proj.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert all(s.data.shape[1] == kernel.shape[1] // 4 for s in kernel.addressable_shards)
    reference, _ = load_model(str(path))
    ids = np.arange(10)[None] % hf["vocab_size"]
    np.testing.assert_allclose(np.asarray(model(ids, np.arange(10)[None])),
                               np.asarray(reference(ids, np.arange(10)[None])), atol=1e-5)


@pytest.mark.parametrize("mesh", [(4, 1)], ids=str)
def test_data_parallel_sampling_equals_single_device(setup: tuple, mesh: tuple[int, int]) -> None:
    """Replicas get their rows' own seeds, sample indices, filters, masked ids and logprob requests:
    seeded T=1 with top-p, n=3 per prompt (siblings on their prompt's replica), `min_tokens` masking a
    stop id, top-2 alternatives and prompt logprobs equal the single-device engine's."""
    model, prompts, _ = setup
    sp = [SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11 + i, max_tokens=10, min_tokens=4,
                         stop_token_ids=[7], logprobs=2, prompt_logprobs=1) for i in range(len(prompts))]
    ref = Engine.from_model(model, IdTokenizer(), **KW).generate(prompts, sp)
    outs = Engine.from_model(model, IdTokenizer(), mesh=mesh, **KW).generate(prompts, sp)
    for a, b in zip(outs, ref):
        np.testing.assert_allclose([t.logprob for t in a.prompt_logprobs[1:]], [t.logprob for t in b.prompt_logprobs[1:]],
                                   atol=1e-5)
        assert len(a.outputs) == 3
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids and 7 not in ca.token_ids[:4]
            np.testing.assert_allclose([t.logprob for t in ca.logprobs], [t.logprob for t in cb.logprobs], atol=1e-5)
            assert [sorted(t.top) for t in ca.logprobs] == [sorted(t.top) for t in cb.logprobs]
    assert len({tuple(c.token_ids) for o in ref for c in o.outputs}) > len(prompts)  # samples differ


def test_filtered_sampling_with_vocab_sharded_logits() -> None:
    """top-k/top-p over logits sharded by vocabulary (this once crashed XLA's SPMD partitioner): every
    row at top_k <= 64 (the best-blocks path, vocabulary large enough for it), then a row at top_k = 100
    (the top-512 path)."""
    cfg = ModelConfig(family="llama", vocab_size=32768, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(5))
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11, max_tokens=6, logprobs=0)
    wide = SamplingParams(temperature=0.8, top_k=100, seed=11, max_tokens=6, logprobs=0)
    prompts = [[5, 6, 7, 8], [900, 901]]
    engines = [Engine.from_model(model, IdTokenizer(), **KW), Engine.from_model(model, IdTokenizer(), mesh=(1, 2), **KW)]
    for params in (sp, [sp, wide]):
        ref, outs = (engine.generate(prompts, params) for engine in engines)
        for a, b in zip(outs, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_sharded_load_reads_each_device_slice_only(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a safetensors checkpoint onto a (1, 4) mesh reads shards, never a whole TP-sharded tensor."""
    from safetensors.numpy import save_file

    import runner.models.loader as loader
    from runner.models.registry import get_family

    family = get_family(CFG.family)
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(5))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    flat = {".".join(map(str, k)): np.asarray(v.value) for k, v in nnx.to_flat_state(params)}
    tensors = {}
    for rule_target, arr in flat.items():
        hf = next(name for name in _hf_names(CFG) if family.map_hf_name(name)[0] == rule_target)
        tensors[hf] = np.ascontiguousarray(arr.T if family.map_hf_name(hf)[1] else arr)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(_hf_config_json(CFG))

    reads: dict[str, list[int]] = {}
    real = jax.make_array_from_callback

    def recording(shape, sharding, callback):  # noqa: ANN001, ANN202
        key = len(reads)
        reads[key] = []

        def cb(index):  # noqa: ANN001, ANN202
            out = callback(index)
            reads[key].append(out.size)
            return out
        arr = real(shape, sharding, cb)
        reads[key] = (int(np.prod(shape)), reads[key], str(sharding.spec))
        return arr

    monkeypatch.setattr(loader.jax, "make_array_from_callback", recording)
    loaded, _ = loader.load_model(str(tmp_path), mesh=make_mesh((1, 4)))
    sharded = [(total, sizes) for total, sizes, spec in reads.values() if "model" in spec]
    assert len(sharded) >= 7 * CFG.num_hidden_layers  # q/k/v/o and MLP kernels of every layer
    for total, sizes in sharded:
        assert max(sizes) == total // 4, (total, sizes)
    got = {".".join(map(str, k)): np.asarray(v.value) for k, v in nnx.to_flat_state(nnx.split(loaded, nnx.Param, ...)[1])}
    for name, arr in flat.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


def _hf_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.{w}" for n in "qkvo" for w in ("weight", "bias")]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return names


def _hf_config_json(cfg: ModelConfig) -> str:
    import json

    return json.dumps(dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=256))


@pytest.mark.parametrize(("mesh", "min_confidence"), [((1, 4), 0.0), ((2, 2), 0.5)], ids=str)
def test_eagle3_drafting_on_a_mesh_equals_single_device(setup: tuple, mesh: tuple[int, int], min_confidence: float,
                                                        tmp_path) -> None:
    """The EAGLE-3 head's cache and draft program over data-parallel replicas and a model axis, every other
    decode call a plain multi-step one; with `min_confidence` (a random head is unsure: its steps decode
    plainly in the verification program)."""
    from rollout import Eagle3Config
    from runner.spec_decode.eagle3_checkpoint import init_eagle3_head, save_eagle3_head

    model, prompts, ref = setup
    save_eagle3_head(init_eagle3_head(model, draft_vocab_ids=np.arange(90)[::-1], seed=1), str(tmp_path))
    engine = Engine.from_model(model, IdTokenizer(), mesh=mesh, **KW,
                               speculative=Eagle3Config(str(tmp_path), k=3, auto_disable=False,
                                                        min_confidence=min_confidence))
    decisions = iter(range(10**6))
    engine.core.speculator._worth_it = lambda seqs: next(decisions) % 2 == 0  # plain multi-step calls fill the cache too
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=0))
    assert_same_as_single_device(outs, ref)
    s = engine.stats().speculative
    assert s.num_unsure_steps > 0 if min_confidence else s.drafted_tokens > 0 and s.num_unsure_steps == 0
    assert s.num_disabled_steps > 0
    cache, main = engine.runner.drafter.cache, engine.runner.kv_caches[0]
    assert cache.kv.sharding.is_equivalent_to(main.sharding, cache.kv.ndim)  # the steps kept both layouts
    want = jax.sharding.NamedSharding(engine.runner.mesh, jax.sharding.PartitionSpec("data" if mesh[0] > 1 else None))
    assert cache.hidden.sharding.is_equivalent_to(want, cache.hidden.ndim)


@pytest.mark.parametrize(("heads", "axis", "q_heads", "kv_heads"), [
    ((8, 4), 4, tuple(range(8)), (0, 1, 2, 3)),  # divides: the checkpoint's own heads
    ((9, 3), 4, (*range(9), -1, -1, -1), (0, 1, 2, -1)),  # SmolLM2: pad 9 / 3 -> 12 / 4
    ((8, 2), 4, tuple(range(8)), (0, 0, 1, 1)),  # replicate each KV head for half its group
    ((3, 1), 4, (0, 1, 2, -1), (0, 0, 0, 0)),  # one KV head on every device, 3 query heads padded to 4
    ((6, 6), 4, (*range(6), -1, -1), (*range(6), -1, -1)),  # multi-head attention: pad 6 -> 8
], ids=str)
def test_head_layout_gives_every_device_whole_heads(heads: tuple[int, int], axis: int, q_heads: tuple,
                                                    kv_heads: tuple) -> None:
    from runner.models.head_layout import HeadLayout

    layout = HeadLayout.for_axis(*heads, 8, axis)
    assert (layout.q_heads, layout.kv_heads) == (q_heads, kv_heads)
    assert len(layout.kv_heads) % axis == 0 and len(layout.q_heads) % axis == 0
    assert layout.is_identity == (heads == (8, 4))
    with pytest.raises(ValueError, match="would read KV head"):  # a query head moved to another group
        HeadLayout(8, 4, 2, (2, 1, 0, 3), (0, 1))


@pytest.mark.parametrize("heads", [(9, 3), (3, 1)], ids=str)
def test_heads_the_model_axis_does_not_divide(heads: tuple[int, int]) -> None:
    """(1, 4) with 9/3 heads (query and KV heads padded) and 3/1 (query heads padded, the KV head
    replicated; every layout case: `test_head_layout_gives_every_device_whole_heads`): the stored model
    computes the checkpoint's function, the KV cache is split by head, and `sync_weights` takes the
    trainer's (checkpoint-layout) parameters."""
    from runner.models.registry import with_head_layout

    cfg = ModelConfig(family="qwen2", vocab_size=96, hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=8, qkv_bias=True)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(3))
    ids, pos = np.arange(20)[None] % 96, np.arange(20)[None]
    stored = with_head_layout(model, 4)
    assert stored.config.num_key_value_heads == 4 and stored.config.head_layout is not None
    from runner.spec_decode.eagle3 import Eagle3HeadConfig  # a head for it has the checkpoint's heads
    assert Eagle3HeadConfig.for_target(stored.config).num_key_value_heads == heads[1]
    np.testing.assert_allclose(np.asarray(stored(ids, pos)), np.asarray(model(ids, pos)), atol=1e-5)

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, size=int(n)).tolist() for n in (5, 30, 17)]
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    engine = Engine.from_model(model, IdTokenizer(), mesh=(1, 4), **KW)
    assert_same_as_single_device(engine.generate(prompts, sp), Engine.from_model(model, IdTokenizer(), **KW)
                                 .generate(prompts, sp))
    kv = engine.runner.kv_caches[0]
    device = engine.runner.mesh.devices.flat[0]
    assert sum(s.data.nbytes for s in kv.addressable_shards if s.device == device) == kv.nbytes // 4

    policy = LlamaForCausalLM(cfg, rngs=nnx.Rngs(8))
    for _ in range(2):  # the second sync reuses the first one's programs
        before = engine.stats().num_compilations
        engine.sync_weights(nnx.split(policy, nnx.Param, ...)[1])  # the trainer's 9/3 (3/1) layout
    assert engine.stats().num_compilations == before
    # the engine's replicated copies (norms) never share a buffer with the trainer's arrays
    assert not any(v[...].is_deleted() for _, v in nnx.to_flat_state(nnx.split(policy, nnx.Param, ...)[1]))
    assert_same_as_single_device(engine.generate(prompts, sp), Engine.from_model(policy, IdTokenizer(), **KW)
                                 .generate(prompts, sp))
    engine.sync_weights(nnx.split(engine.model, nnx.Param, ...)[1])  # its own stored layout syncs as is
    with pytest.raises(Exception, match="nor expands to it"):
        bad = dataclasses.replace(cfg, num_attention_heads=heads[0] * 2, num_key_value_heads=heads[1] * 2)
        engine.sync_weights(nnx.split(LlamaForCausalLM(bad, rngs=nnx.Rngs(0)), nnx.Param, ...)[1])
    assert_same_as_single_device(engine.generate(prompts, sp), Engine.from_model(policy, IdTokenizer(), **KW)
                                 .generate(prompts, sp))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_sharded_load_pads_heads_reading_slices_only(tmp_path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 6 / 3-head llama checkpoint onto (1, 4): stored as 8 / 4 heads, every device reads only
    its own slice of the source (the padded device's query / KV slices read nothing), and the
    model equals the unsharded load."""
    from helpers_models import hf_config, random_tensors, write_gguf, write_hf_dir

    import runner.models.loader as loader

    hf = hf_config("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=64)
    tensors = random_tensors(hf)
    path = (write_hf_dir(tmp_path / "ckpt", hf, tensors) if fmt == "safetensors"
            else write_gguf(tmp_path / "tiny.gguf", hf, tensors))
    reads: list[tuple[tuple[int, ...], int]] = []
    real = loader.ExpandedColumns.__getitem__

    def recording(self, index):  # noqa: ANN001, ANN202
        out = real(self, index)
        reads.append((self.shape, int((self.index[index[self.axis]] >= 0).sum())))
        return out

    monkeypatch.setattr(loader.ExpandedColumns, "__getitem__", recording)
    model, cfg = loader.load_model(str(path), mesh=make_mesh((1, 4)))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 4) and cfg.head_layout is not None
    assert len(reads) == 4 * 7 * hf["num_hidden_layers"]  # q/k/v kernels and biases, o kernel: 4 slices each
    assert sorted({n for _, n in reads}) == [0, 8, 16]  # head_dim 8: a KV head, two query heads, or padding
    kernel = model.layers[0].self_attn.k_proj.kernel[...]
    assert all(s.data.shape[1] == 8 for s in kernel.addressable_shards)
    reference, _ = loader.load_model(str(path))
    ids, pos = np.arange(10)[None] % hf["vocab_size"], np.arange(10)[None]
    np.testing.assert_allclose(np.asarray(model(ids, pos)), np.asarray(reference(ids, pos)), atol=1e-5)
