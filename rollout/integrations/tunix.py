"""`JaxRollout`: the engine as a Tunix rollout engine (`pip install -e ".[tunix]"`; imported only when used).

    from rollout.integrations.tunix import JaxRollout
    cluster_config = rl_cluster.ClusterConfig(rollout_engine=JaxRollout, ...)   # instead of "vanilla"
    # engine settings: rollout_engine=functools.partial(JaxRollout, max_num_seqs=128)

Tunix builds it from its rollout actor (a Tunix Llama3 / Qwen2 / Qwen3 model), tokenizer, mesh and
`RolloutConfig`; the engine's model is built from the actor's parameters in memory, and
`update_params` syncs new ones in place (no reload, no compile). Each run of identical prompts (a
GRPO group) becomes one request with n samples, so the group shares its prompt's KV blocks.
Tunix's trainer masks every prompt token equal to the pad id (attention and positions skip it: a
tokenizer whose pad is its EOS loses each `<|im_end|>` of a chat prompt that way), so the engine is
given the prompt without them: it samples from the distribution Tunix trains.

`RolloutConfig` fields: `max_tokens_to_generate`, `temperature` (0: greedy), `top_p`, `top_k`, `seed`,
`max_prompt_length` (the width of `left_padded_prompt_tokens`, widened to the next power of two for a
longer prompt, as Tunix's vanilla sampler does), `eos_tokens` (else the tokenizer's EOS), `return_logprobs`
(`log_softmax(logits / T)` of the sampled token, T = 1 when greedy, without the top-k / top-p
renormalisation: what Tunix's vanilla sampler returns and `compute_per_token_logps(..., temperature=T)`
recomputes; with filters on, the engine's processed logprob plus the sampling record's kept log-mass),
`data_type` (at construction), `tensor_parallel_size` / `data_parallel_size` (the engine's mesh over
Tunix's rollout devices). `kv_cache_size` only sets the longest sequence the engine holds. Refused
with a ValueError: `rollout_mapping_config` and `expert_parallel_size` != 1 (experts split over the
tensor-parallel axis). The `rollout_vllm_*` and `rollout_sglang_jax_*` fields belong to those engines
and are not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.generate.utils import next_power_of_2
from tunix.rl.rollout import base_rollout

from rollout.engine import Engine
from rollout.integrations.tunix_models import engine_model, params_dtype, sync_rules
from rollout.sampling_params import SamplingParams

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


class _TokenizerBridge:
    """A Tunix tokenizer (adapter) with the methods the engine calls."""

    def __init__(self, tokenizer: TokenizerAdapter, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._tok, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_ids
        self.eos_token_id, self.pad_token_id, self.bos_token_id = eos_ids[0], tokenizer.pad_id(), tokenizer.bos_id()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids))


class JaxRollout(base_rollout.BaseRollout):
    """Tunix's `BaseRollout` over a jax-rollout `Engine` (see the module doc)."""

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, **engine_config: object) -> None:
        config = rollout_config or base_rollout.RolloutConfig()
        self._check_config(config)
        self._tokenizer = tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(tokenizer)
        self._actor = rollout_actor
        dtype = (str(jnp.dtype(config.data_type)) if config.data_type is not None else params_dtype(rollout_actor))
        if dtype not in _DTYPES:
            raise ValueError(f"RolloutConfig.data_type must be float32 or bfloat16, got {dtype}")
        max_len = max(config.kv_cache_size, config.max_prompt_length + config.max_tokens_to_generate)
        max_len = -(-max_len // 16) * 16
        model = engine_model(rollout_actor, dtype=dtype, max_model_len=max_len)
        bridge = _TokenizerBridge(self._tokenizer, model.config.vocab_size, (self._tokenizer.eos_id(),))
        engine_config.setdefault("max_model_len", max_len)
        engine_config.setdefault("max_num_seqs", 64)
        self.engine = Engine.from_model(model, bridge, mesh=self._engine_mesh(mesh, config), **engine_config)
        self._rules = sync_rules(rollout_actor)
        self._logps = nnx.jit(_per_token_logps, static_argnames=("pad_id",))
        self.update_params(nnx.state(rollout_actor, nnx.Param))  # compiles the sync's layout programs now, once

    @staticmethod
    def _check_config(config: base_rollout.RolloutConfig) -> None:
        if config.rollout_mapping_config is not None:
            raise ValueError("RolloutConfig.rollout_mapping_config is for the vLLM / SGLang-JAX engines; this engine "
                             "maps Tunix's models itself (weight_sync.tunix_presets): leave it None")
        if config.expert_parallel_size not in (1, -1):
            raise ValueError(f"RolloutConfig.expert_parallel_size={config.expert_parallel_size}: this engine splits "
                             "experts over the tensor-parallel axis; leave it 1 and set tensor_parallel_size")

    @staticmethod
    def _engine_mesh(mesh: Mesh | None, config: base_rollout.RolloutConfig) -> Mesh | None:
        """The engine's (data, model) mesh over Tunix's rollout devices."""
        devices = np.asarray(mesh.devices).reshape(-1) if mesh is not None else np.asarray(jax.devices()[:1])
        dp = config.data_parallel_size if config.data_parallel_size > 0 else 1
        tp = config.tensor_parallel_size if config.tensor_parallel_size > 0 else len(devices) // dp
        if dp * tp != len(devices):
            raise ValueError(f"data_parallel_size {dp} x tensor_parallel_size {tp} must equal the rollout mesh's "
                             f"{len(devices)} devices")
        return Mesh(devices.reshape(dp, tp), ("data", "model"))

    # ---- BaseRollout -------------------------------------------------------------------------
    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs: object) -> base_rollout.RolloutOutput:
        """Complete every prompt (identical consecutive prompts as one request with n samples)."""
        self._check_config(rollout_config)
        params = self._sampling(rollout_config)
        token_lists = [self._tokenize(p) for p in prompts]
        width = rollout_config.max_prompt_length
        if max(map(len, token_lists)) > width:
            width = next_power_of_2(max(map(len, token_lists)))  # as Tunix's vanilla sampler widens
        pad = self.pad_id()
        runs: list[tuple[list[int], int]] = []
        for ids in token_lists:
            ids = [t for t in ids if t != pad]  # what Tunix's trainer sees: it masks every pad-valued token
            if not ids:
                raise ValueError("a prompt is empty once the tokenizer's pad-valued tokens are dropped")
            if runs and runs[-1][0] == ids:
                runs[-1] = (ids, runs[-1][1] + 1)
            else:
                runs.append((ids, 1))
        seed = _seed(rollout_config.seed)
        per_run = [dataclasses.replace(params, n=n, seed=None if seed is None else (seed + 7919 * i) % 2**32)
                   for i, (_, n) in enumerate(runs)]
        outs = self.engine.generate([ids for ids, _ in runs], per_run)
        stops = set(rollout_config.eos_tokens or [self._tokenizer.eos_id()])
        tokens, logprobs = [], []
        for out in outs:
            for c in out.outputs:
                n = len(c.token_ids) - (1 if c.token_ids and c.finish_reason == "stop" and c.token_ids[-1] in stops else 0)
                tokens.append(np.asarray(c.token_ids[:n], np.int32))
                if rollout_config.return_logprobs:
                    values = np.asarray(c.logprobs.values[:n], np.float64)
                    if c.kept_logmass is not None:  # undo the filters' renormalisation
                        values += np.asarray(c.kept_logmass[:n], np.float64)
                    logprobs.append(values.astype(np.float32))
        left_padded = np.full((len(token_lists), width), pad, np.int32)
        for i, ids in enumerate(token_lists):
            left_padded[i, width - len(ids):] = ids
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=[], tokens=tokens,
            left_padded_prompt_tokens=left_padded, logprobs=logprobs if rollout_config.return_logprobs else None)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """log p(completion token | everything before it) under the engine's current weights."""
        return self._logps(self.engine.model, jnp.asarray(prompt_tokens), jnp.asarray(completion_tokens),
                           pad_id=self.pad_id())

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """The trainer's new parameters (Tunix's layout, or the engine's own model's), in place."""
        if filter_types is not None and any(t is not nnx.Param for t in filter_types):
            raise ValueError(f"update_params takes full parameters (nnx.Param); got filter_types {filter_types}: "
                             "merge LoRA weights into the base model first")
        flat = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(params)} if isinstance(params, nnx.State) else set()
        mapping = None if any(p.startswith("embed_tokens") for p in flat) else self._rules
        with jax.transfer_guard("allow"):  # Tunix forbids implicit transfers around weight syncs on CPU
            self.engine.sync_weights(params, mapping=mapping)

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self) -> None:
        """None, as Tunix's vLLM rollout answers: the engine's model is not a Tunix model (Tunix compares
        its state with the actor's); `self.engine.model` is the engine's own."""
        return None

    # ---- helpers -----------------------------------------------------------------------------
    def _tokenize(self, prompt: str) -> list[int]:
        """Tunix's sampler's prompt ids: BOS (when the tokenizer has a non-zero one) + the text, one BOS."""
        ids = list(self._tokenizer.encode(prompt))
        bos = [self._tokenizer.bos_id()] if self._tokenizer.bos_id() else []
        return [int(t) for t in self._tokenizer.dedup_bos_ids(bos + ids)]

    def _sampling(self, c: base_rollout.RolloutConfig) -> SamplingParams:
        eos = self._tokenizer.eos_id()
        stop_ids = [t for t in (c.eos_tokens or []) if t != eos]
        top_p = 1.0 if c.top_p is None else float(c.top_p)
        top_k = 0 if c.top_k is None or c.top_k < 0 else int(c.top_k)
        return SamplingParams(
            temperature=float(c.temperature), top_p=top_p, top_k=top_k, max_tokens=int(c.max_tokens_to_generate),
            stop_token_ids=stop_ids, ignore_eos=bool(c.eos_tokens) and eos not in c.eos_tokens,
            logprobs=0 if c.return_logprobs else None, logprobs_mode="processed", detokenize=False,
            sampling_record=bool(c.return_logprobs) and (top_k > 0 or top_p < 1.0))


def _seed(seed: object) -> int | None:
    """Tunix's seed (None, an int, or a PRNG key) as the engine's 32-bit seed."""
    if seed is None:
        return None
    if isinstance(seed, (int, np.integer)):
        return int(seed) % 2**32
    data = np.asarray(jax.random.key_data(seed) if jnp.issubdtype(jnp.asarray(seed).dtype, jax.dtypes.prng_key)
                      else seed).reshape(-1)
    return int(data[-1]) % 2**32


def _per_token_logps(model: nnx.Module, prompt_tokens: Int[Array, "B P"], completion_tokens: Int[Array, "B C"],
                     *, pad_id: int) -> Float[Array, "B C"]:
    """Tunix's `compute_per_token_logps` on the engine's model: positions count non-pad tokens only."""
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
    mask = (tokens != pad_id).astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits = model(tokens, positions, mask)
    width = completion_tokens.shape[1]
    logp = jax.nn.log_softmax(logits[:, -width - 1:-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, completion_tokens[..., None], axis=-1)[..., 0]
