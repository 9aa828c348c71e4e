"""`Engine`: the public entry point. It builds the model runner and the engine core (the request
table and its step: `rollout/engine_core.py`); `generate` and `rollout` are blocking clients of the
core's `add_request` / `step`."""

from __future__ import annotations

import dataclasses
import gc
from typing import Sequence as Seq

from jax.sharding import Mesh
from tqdm import tqdm

from rollout.engine_config import EngineConfig, EngineStats
from rollout.engine_core import EngineCore
from rollout.outputs import RequestOutput, RolloutBatch
from rollout.request_validation import Prompt, normalize_requests, prompt_token_ids
from rollout.rollout_batch import build_rollout_batch, build_trajectory_batch
from rollout.sampling_params import SamplingParams
from rollout.tokenizer import Tokenizer, load_tokenizer
from rollout.trajectory import Trajectory
from runner.build import build_runner
from runner.compilation_cache import default_cache_dir, enable_compilation_cache, executables_dir
from runner.compile_counter import num_compilations
from runner.models.family import CausalLM
from runner.models.loader import load_model
from runner.sharding import make_mesh


class Engine(EngineCore):
    """Continuous-batching rollout engine over a paged KV cache.

    Request API (from `EngineCore`): `add_request`, `step`, `abort`, `has_unfinished_requests`,
    `sync_weights` (legal between any two steps). Blocking clients: `generate`, `rollout`."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 mesh: Mesh | tuple[int, int] | None = None) -> None:
        cache_dir = _use_compilation_cache(config)
        device_mesh = make_mesh(mesh)
        if config.record_routed_experts and not model.config.moe_layers:
            raise ValueError("record_routed_experts needs a mixture-of-experts model; this one has no routed-experts "
                             "layers (leave it False)")
        runner = build_runner(model, device_mesh, config.runner_options(
            None if cache_dir is None else executables_dir(cache_dir)))
        cfg = self.model_config = runner.config
        super().__init__(runner, tokenizer, config,
                         eos_token_ids=tuple(dict.fromkeys([*cfg.eos_token_ids, *tokenizer.eos_token_ids])))
        self._compiles_at_start = num_compilations()
        if config.freeze_gc:
            freeze_heap()

    @classmethod
    def from_pretrained(cls, path: str | None = None, *, dtype: str = "auto",
                        mesh: Mesh | tuple[int, int] | None = None, **config: object) -> "Engine":
        """Load a HF directory, a `.gguf` file, or (None) the embedded SmolLM2-135M-Instruct.

        `dtype`: "float32", "bfloat16", or "auto" (bfloat16 on a TPU, float32 elsewhere). `mesh`: None
        (one device), a `(data, model)` size pair, or a Mesh with those axes.
        """
        engine_config = EngineConfig(**config)  # validate before the (slow) load
        _use_compilation_cache(engine_config)
        device_mesh = make_mesh(mesh)
        if dtype == "auto":
            dtype = "bfloat16" if device_mesh.devices.flat[0].platform == "tpu" else "float32"
        model, _ = load_model(path, dtype=dtype, mesh=device_mesh)  # straight into the sharded layout
        return cls(model, load_tokenizer(path), engine_config, device_mesh)

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Tokenizer, *,
                   mesh: Mesh | tuple[int, int] | None = None, **config: object) -> "Engine":
        """Serve a model the trainer already holds (the engine keeps its own copy of the parameters;
        push updates with `sync_weights`)."""
        return cls(model, tokenizer, EngineConfig(**config), mesh)

    # ---- blocking clients -------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt; returns one `RequestOutput` per prompt, in order.

        Every prompt is validated before any is queued. Requests added with `add_request` before the
        call run alongside; their outputs of these steps are returned by the next `step()`."""
        prompts_list, params_list = normalize_requests(prompts, sampling_params)
        token_lists = [prompt_token_ids(p, sp, self.tokenizer, self._limits) for p, sp in zip(prompts_list, params_list)]
        distinct = {id(sp): sp for sp in params_list}  # a copy validates itself: one per distinct object
        final_only = {key: dataclasses.replace(sp, output_kind="final_only") for key, sp in distinct.items()}
        mine = [self._add(prompt if isinstance(prompt, str) else None, ids, final_only[id(sp)],
                          self._check_request_id(None))
                for prompt, ids, sp in zip(prompts_list, token_lists, params_list)]
        results: dict[str, RequestOutput] = {}
        wanted = set(mine)
        bar = tqdm(total=len(mine), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(mine):
                if self.admission_held():
                    raise RuntimeError(
                        f"lag-aware admission holds every waiting sample (max_policy_lag={self.config.max_policy_lag}, "
                        f"samples_per_version={self.config.samples_per_version}: {self.scheduler.num_started} "
                        "started): a blocking generate() cannot wait for sync_weights; use add_request/step or "
                        "AsyncEngine, or ask for fewer samples per call")
                for out in self.step():
                    if out.request_id in results or out.request_id not in wanted:  # final-only: one output each
                        self._deferred.append(out)  # another caller's request: kept for its next step()
                    else:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.abort([rid for rid in mine if rid not in results])  # the engine stays usable
            self.block_manager.invalidate_prefix_cache()  # nothing computed in a failed call is reused
            self._deferred = [o for o in self._deferred if o.request_id not in wanted]
            raise
        finally:
            bar.close()
        return [results[rid] for rid in mine]

    def rollout(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                *, use_tqdm: bool = False) -> RolloutBatch:
        """`generate`, then pack prompt + completions as padded arrays for a policy-gradient loss."""
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return build_rollout_batch(outputs, pad_id=pad_id, policy_version=self.policy_version)

    def trajectory_batch(self, trajectories: list[Trajectory], group_ids: list[int] | None = None) -> RolloutBatch:
        """Pack multi-turn trajectories for a loss: environment tokens are masked out (rollout/trajectory.py)."""
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return build_trajectory_batch(trajectories, pad_id=pad_id, policy_version=self.policy_version,
                                      group_ids=group_ids)

    # ---- colocation with a trainer on one accelerator ---------------------------------------------
    def sleep(self, *, offload_weights: bool = False) -> None:
        """Free the KV cache's device memory (and, with `offload_weights`, move the weights to host
        memory) while the trainer needs the accelerator; `wake()` restores both without compiling.
        Refused while requests are unfinished (abort or finish them first); nothing runs while asleep."""
        if self.requests or self.has_unfinished_requests():
            raise RuntimeError(f"sleep() with {len(self.requests)} unfinished request(s): finish or abort them first")
        self.runner.release(offload_weights=offload_weights)
        self.block_manager.invalidate_prefix_cache()  # the cached K/V is gone

    def wake(self) -> None:
        """Bring back what `sleep` freed (a zeroed KV cache, the weights as they were)."""
        self.runner.restore()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.released

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (the next requests recompute their prompts)."""
        self.block_manager.invalidate_prefix_cache()

    @property
    def model(self) -> CausalLM:
        """The model bound to the engine's current parameters (for a reference forward pass)."""
        return self.runner.model

    def warmup(self, *, prompt_logprobs: bool = False, use_tqdm: bool = False) -> int:
        """Compile every step bucket now (not during the first calls); returns the number of programs.
        With the persistent compilation cache (`EngineConfig.compilation_cache_dir`) a second process
        loads them instead.

        Requests with `prompt_logprobs` use their own prefill programs: pass `prompt_logprobs=True`
        to compile those too.
        """
        spec = self.config.speculative
        return self.runner.warmup(prompt_logprobs=prompt_logprobs, speculative_k=spec.k if spec else 0,
                                  rejection=self._rejection, use_tqdm=use_tqdm)

    def stats(self) -> EngineStats:
        """Counters since the engine was built (a copy)."""
        backend = self.runner.backend.status()
        return dataclasses.replace(
            self.stats_, num_preemptions=self.scheduler.num_preemptions, num_lag_held=self.scheduler.num_held,
            prefix_cache_hit_tokens=self.block_manager.num_cache_hit_tokens,
            prefix_cache_queried_tokens=self.block_manager.num_cache_queried_tokens,
            num_compilations=num_compilations() - self._compiles_at_start,
            backend=backend.name, cpu_row_kernel=backend.matmul, cpu_amx=backend.amx, attention_impl=backend.attention,
            cpu_bf16_matmul=backend.bf16_matmul, batch_invariant=backend.batch_invariant,
            attention_kernel=backend.attention_kernel,
            speculative=dataclasses.replace(self.speculator.stats) if self.speculator is not None else None)


def _use_compilation_cache(config: EngineConfig) -> str | None:
    """Turn on JAX's persistent cache as configured (a folder the process configured before wins: the
    setting is process-wide); returns the engine's own folder (None: off), where its executables go."""
    if config.compilation_cache_dir is None:
        return None
    folder = default_cache_dir() if config.compilation_cache_dir == "auto" else config.compilation_cache_dir
    enable_compilation_cache(folder)
    return folder


def freeze_heap() -> None:
    """Move every live object to the collector's permanent generation (`EngineConfig.freeze_gc`): a
    full collection during a rollout then scans only what was made since (docs/engineering-notes.md:
    "Host work of a multi-step decode call"). Objects an earlier engine froze are
    unfrozen and collected first, so engines built one after another leave no garbage cycles behind."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
