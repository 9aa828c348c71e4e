"""`Engine`: the public entry point. It builds the model runner (`runner.build.build_runner`) and holds the
engine core (the request table and its step: `rollout/engine_core.py`), whose request API it offers;
`generate` and `rollout` are blocking clients of the core's `add_request` / `step`."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterable
from typing import Sequence as Seq

from jax.sharding import Mesh
from tqdm import tqdm

from rollout.engine_config import EngineConfig, EngineStats
from rollout.engine_core import EngineCore
from rollout.outputs import RequestOutput, RolloutBatch
from rollout.request_validation import Prompt, normalize_requests
from rollout.rollout_batch import build_rollout_batch, build_trajectory_batch
from rollout.sampling_params import SamplingParams
from rollout.tokenizer import Tokenizer, load_tokenizer
from rollout.trajectory import Trajectory
from runner.build import build_runner
from runner.compilation_cache import default_cache_dir, enable_compilation_cache, executables_dir
from runner.model_runner import ModelRunner
from runner.models.config import ModelConfig
from runner.models.family import CausalLM
from runner.models.loader import load_model
from runner.sharding import make_mesh


class Engine:
    """Continuous-batching rollout engine over a paged KV cache.

    Request API (its `EngineCore`, `engine.core`): `add_request`, `step`, `abort`, `resume`,
    `has_unfinished_requests`, `sync_weights` (legal between any two steps). Blocking clients: `generate`,
    `rollout`."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 mesh: Mesh | tuple[int, int] | None = None) -> None:
        cache_dir = _use_compilation_cache(config)
        if config.record_routed_experts and not model.config.moe_layers:
            raise ValueError("record_routed_experts needs a mixture-of-experts model; this one has no routed-experts "
                             "layers (leave it False)")
        runner = build_runner(model, make_mesh(mesh), config.runner_options(
            None if cache_dir is None else executables_dir(cache_dir)))
        eos = tuple(dict.fromkeys([*runner.config.eos_token_ids, *tokenizer.eos_token_ids]))
        self.core = EngineCore(runner, tokenizer, config, eos)
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
        """Serve a model the trainer already holds; push updates with `sync_weights`. By default the engine
        keeps its own copy of the parameters; with `share_weights=True` (an `EngineConfig` field) the
        parameters already laid out as the engine's are the trainer's own arrays (no second copy), and a
        `sync_weights` of such a tree swaps references. A trainer that then donates or deletes those arrays
        gets `SharedWeightsDeleted` at the next step: sync the new ones first."""
        return cls(model, tokenizer, EngineConfig(**config), mesh)

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def model_config(self) -> ModelConfig:
        return self.core.runner.config

    @property
    def policy_version(self) -> int | None:
        """The version of the weights in force (None until the first `sync_weights`, or until set: a trainer
        may name the initial weights' version)."""
        return self.core.policy_version

    @policy_version.setter
    def policy_version(self, version: int | None) -> None:
        self.core.policy_version = version

    # ---- the request API (`EngineCore`) -----------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id. `EngineCore.add_request`."""
        return self.core.add_request(prompt, params, request_id)

    def check_request(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or the `ValueError` `add_request` would raise (nothing is queued)."""
        return self.core.requests.prompt_ids(prompt, params)

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that changed. `EngineCore.step`."""
        return self.core.step()

    def abort(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now; their final outputs. `EngineCore.abort`."""
        return self.core.abort(request_ids)

    def resume(self, request_id: str, params: SamplingParams | None = None) -> str:
        """Continue an ended request cut by `max_tokens` or aborted. `EngineCore.resume`."""
        return self.core.resume(request_id, params)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def admission_held(self) -> bool:
        """Every unfinished sample waits for a new policy version (`EngineCore.admission_held`)."""
        return self.core.admission_held()

    def sync_weights(self, params: object, mapping: str | tuple | list | None = None, *,
                     version: int | None = None, check_finite: bool = False,
                     draft_params: object | None = None, draft_mapping: str | tuple | list | None = None,
                     recompute_running: bool = False, share_weights: bool | None = None) -> None:
        """New policy parameters, in place, between steps (no reload, no compile). `EngineCore.sync_weights`."""
        self.core.sync_weights(params, mapping, version=version, check_finite=check_finite, draft_params=draft_params,
                               draft_mapping=draft_mapping, recompute_running=recompute_running,
                               share_weights=share_weights)

    # ---- blocking clients -------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt; returns one `RequestOutput` per prompt, in order.

        Every prompt is validated before any is queued. Requests added with `add_request` before the
        call run alongside; their outputs of these steps are returned by the next `step()`."""
        core = self.core
        prompts_list, params_list = normalize_requests(prompts, sampling_params)
        token_lists = [core.requests.prompt_ids(p, sp) for p, sp in zip(prompts_list, params_list)]
        distinct = {id(sp): sp for sp in params_list}  # a copy validates itself: one per distinct object
        final_only = {key: dataclasses.replace(sp, output_kind="final_only") for key, sp in distinct.items()}
        mine = [core.add_checked(prompt if isinstance(prompt, str) else None, ids, final_only[id(sp)],
                                 core.requests.new_id(None))
                for prompt, ids, sp in zip(prompts_list, token_lists, params_list)]
        results: dict[str, RequestOutput] = {}
        wanted = set(mine)
        bar = tqdm(total=len(mine), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(mine):
                if core.admission_held():
                    raise RuntimeError(
                        f"lag-aware admission holds every waiting sample (max_policy_lag={self.config.max_policy_lag}, "
                        f"samples_per_version={self.config.samples_per_version}: {core.scheduler.num_started} "
                        "started): a blocking generate() cannot wait for sync_weights; use add_request/step or "
                        "AsyncEngine, or ask for fewer samples per call")
                for out in core.step():
                    if out.request_id in results or out.request_id not in wanted:  # final-only: one output each
                        core.defer([out])  # another caller's request: kept for its next step()
                    else:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            core.abort([rid for rid in mine if rid not in results])  # the engine stays usable
            core.block_manager.invalidate_prefix_cache()  # nothing computed in a failed call is reused
            core.drop_deferred(wanted)
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
        if len(self.core.requests) or self.has_unfinished_requests():
            raise RuntimeError(f"sleep() with {len(self.core.requests)} unfinished request(s): finish or abort them "
                               "first")
        self.runner.release(offload_weights=offload_weights)
        self.core.block_manager.invalidate_prefix_cache()  # the cached K/V is gone

    def wake(self) -> None:
        """Bring back what `sleep` freed (a zeroed KV cache, the weights as they were)."""
        self.runner.restore()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.released

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (the next requests recompute their prompts)."""
        self.core.block_manager.invalidate_prefix_cache()

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
                                  rejection=spec is not None and spec.verification == "rejection", use_tqdm=use_tqdm)

    def stats(self) -> EngineStats:
        """Counters since the engine was built (a copy). `EngineCore.stats`."""
        return self.core.stats()


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
