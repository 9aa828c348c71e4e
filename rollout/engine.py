"""`Engine`: the public entry point. `generate` runs steps of schedule -> run -> postprocess."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence as Seq

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

import weight_sync
from weight_sync.apply import reject_non_finite

from rollout.block_manager import BlockManager
from rollout.engine_config import EngineConfig, EngineStats
from rollout.output_processor import OutputProcessor
from rollout.outputs import RequestOutput, RolloutBatch
from rollout.request_validation import Prompt, RequestLimits, normalize_requests, prompt_token_ids
from rollout.rollout_batch import build_rollout_batch
from rollout.sampling_params import SamplingParams
from rollout.scheduler import Scheduler, SchedulerConfig
from rollout.sequence import Sequence
from rollout.speculator import Speculator
from rollout.step_builder import build_step
from rollout.tokenizer import Tokenizer, load_tokenizer
from runner.attention import auto_attention_impl
from runner.buckets import BucketConfig
from runner.compile_counter import num_compilations
from runner.kv_cache import KVCacheSpec
from runner.model_runner import MAX_SUPPRESS, ModelRunner
from runner.spec_decode.eagle3_checkpoint import load_eagle3_head
from runner.spec_decode.eagle3_config import Eagle3Config
from runner.models.head_layout import with_head_layout
from runner.models.llama import LlamaForCausalLM
from runner.models.loader import load_model
from runner.sharding import make_mesh


class Engine:
    """Continuous-batching rollout engine over a paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 mesh: Mesh | tuple[int, int] | None = None) -> None:
        device_mesh = make_mesh(mesh)
        model = with_head_layout(model, device_mesh.shape["model"])  # whole heads on every device
        cfg = model.config
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = cfg
        self.eos_token_ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *tokenizer.eos_token_ids]))
        self._limits = RequestLimits(cfg.vocab_size, config.max_model_len, config.max_logprobs, self.eos_token_ids,
                                     MAX_SUPPRESS)
        block_size = config.block_size
        num_replicas = device_mesh.shape["data"]  # data parallel: each replica has its own KV blocks and budgets
        max_pages = -(-config.max_model_len // block_size)
        num_blocks = config.kv_cache_blocks
        if num_blocks is None and config.kv_cache_memory_bytes is None:
            num_blocks = config.max_num_seqs * max_pages
        kv_spec = KVCacheSpec.for_model(cfg, block_size=block_size, num_blocks=num_blocks,
                                        memory_bytes=config.kv_cache_memory_bytes)
        if kv_spec.num_blocks < max_pages:
            raise ValueError(f"the KV cache ({kv_spec.num_blocks} blocks of {block_size}) cannot hold one sequence "
                             f"of max_model_len={config.max_model_len}; give at least {max_pages} blocks")
        kv_spec = dataclasses.replace(kv_spec, num_blocks=kv_spec.num_blocks * num_replicas, num_replicas=num_replicas)
        spec = config.speculative
        buckets = BucketConfig(config.max_num_seqs, config.max_num_batched_tokens, max_pages,
                               verify_rows=spec.k + 1 if spec is not None else 0)
        attention_impl = auto_attention_impl(config.attention_backend, device_mesh.devices.flat[0].platform,
                                             device_mesh.shape["model"], kv_spec.dtype, device_mesh.size)
        draft_head, verify_steps = None, spec.num_verify_steps if isinstance(spec, Eagle3Config) else 1
        if isinstance(spec, Eagle3Config):
            draft_head = load_eagle3_head(spec.path, cfg, aux_layer_ids=spec.aux_layer_ids)
        self.runner = ModelRunner(model, kv_spec, buckets, max_logprobs=config.max_logprobs, mesh=device_mesh,
                                  attention_impl=attention_impl, draft_head=draft_head,
                                  num_scheduler_steps=config.num_scheduler_steps,
                                  draft_min_confidence=spec.min_confidence
                                  if isinstance(spec, Eagle3Config) else 0.0, num_verify_steps=verify_steps)
        self.block_manager = BlockManager(kv_spec.num_blocks, block_size, num_replicas=num_replicas,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.speculator = None if spec is None else Speculator(
            spec, config.max_model_len, config.max_num_batched_tokens,
            draft_fn=self._eagle_drafts if draft_head is not None else None)
        self._rejection = spec is not None and spec.verification == "rejection"
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.max_model_len,
                                                   decode_steps=(1 + (spec.k if spec else 0)) * verify_steps,
                                                   num_replicas=num_replicas,
                                                   num_scheduler_steps=config.num_scheduler_steps),
                                   self.block_manager)
        self.outputs = OutputProcessor(self.scheduler, tokenizer, self.eos_token_ids, config.max_model_len)
        self.rng = np.random.default_rng(config.seed)
        self.policy_version: int | None = None
        self.stats_ = EngineStats()
        self._compiles_at_start = num_compilations()
        self._next_id = 0
        self._generating = False
        self._takes: dict[str, tuple[int, tuple[int, ...]]] | None = None

    @classmethod
    def from_pretrained(cls, path: str | None = None, *, dtype: str = "float32",
                        mesh: Mesh | tuple[int, int] | None = None, **config: object) -> "Engine":
        """Load a HF directory, a `.gguf` file, or (None) the embedded SmolLM2-135M-Instruct.

        `mesh`: None (one device), a `(data, model)` size pair, or a Mesh with those axes.
        """
        engine_config = EngineConfig(**config)  # validate before the (slow) load
        device_mesh = make_mesh(mesh)
        model, _ = load_model(path, dtype=dtype, mesh=device_mesh)  # straight into the sharded layout
        return cls(model, load_tokenizer(path), engine_config, device_mesh)

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, tokenizer: Tokenizer, *,
                   mesh: Mesh | tuple[int, int] | None = None, **config: object) -> "Engine":
        """Serve a model the trainer already holds (the engine keeps its own copy of the parameters;
        push updates with `sync_weights`)."""
        return cls(model, tokenizer, EngineConfig(**config), mesh)

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete every prompt; returns one `RequestOutput` per prompt, in order."""
        prompts_list, params_list = normalize_requests(prompts, sampling_params)
        token_lists = [prompt_token_ids(p, sp, self.tokenizer, self._limits) for p, sp in zip(prompts_list, params_list)]
        requests: list[tuple[int, str | None, list[Sequence]]] = []
        for prompt, ids, sp in zip(prompts_list, token_lists, params_list):
            requests.append(self._add_request(prompt if isinstance(prompt, str) else None, ids, sp))
        total = sum(len(seqs) for _, _, seqs in requests)
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm)
        start = time.perf_counter()
        self._generating = True
        try:
            while self.scheduler.has_unfinished():
                bar.update(len(self.step()))
        except BaseException:
            for rid, _, seqs in requests:  # drop this call's unfinished work; the engine stays usable
                self.scheduler.abort(seqs)
                self.scheduler.forget_request(rid)
            # the failed step's blocks were published for prefix sharing when scheduled, maybe never computed
            self.block_manager.invalidate_prefix_cache()
            raise
        finally:
            self._generating = False
            bar.close()
        self.stats_.generate_seconds += time.perf_counter() - start
        self.stats_.generated_tokens += sum(s.num_output_tokens for _, _, seqs in requests for s in seqs)
        results = [self.outputs.request_output(rid, prompt, seqs, self.policy_version) for rid, prompt, seqs in requests]
        for rid, _, _ in requests:
            self.scheduler.forget_request(rid)
        return results

    def step(self) -> list[Sequence]:
        """One engine step: schedule -> run -> postprocess. Returns the sequences that finished."""
        batch, drafts = self.scheduler.schedule(), None
        start = time.perf_counter()  # a speculative step's time includes drafting (n-gram lookup, EAGLE head)
        if self.speculator is not None:
            batch, drafts = self.speculator.propose(batch)
        result = self.runner.run(build_step(batch, self.eos_token_ids, drafts, rejection=self._rejection,
                                            multi_step=self.config.num_scheduler_steps > 1,
                                            device_drafts=self.runner.drafter is not None))
        if drafts is not None and result.draft_ids is not None and result.steps == 1:  # made on the device: now known
            drafts = [result.draft_ids[i, :len(d)] for i, d in enumerate(drafts)]
        steps = float(np.mean(batch.num_new_tokens))
        if drafts is None:
            finished = self.outputs.process(batch, result)
        elif result.steps > 1:  # multi-step verification: every step's drafts come back
            finished, records, num_steps = self.outputs.process_verify_steps(batch, result)
            for seq, drafted, accepted in records:
                self.speculator.record_acceptance(seq, drafted, accepted, accepted + 1, self.policy_version)
            self.speculator.record_verify_steps(num_steps)
            steps = float(num_steps)
        else:
            finished, accepted = self.outputs.process_verified(batch, result, drafts)
            if result.verified:
                for seq, d, a in zip(batch.seqs, drafts, accepted):
                    self.speculator.record_acceptance(seq, len(d), a, a + 1, self.policy_version)
            else:  # the head was unsure: the device decoded this step plainly
                self.speculator.record_unsure(batch.seqs)
        if self.speculator is not None and not batch.is_prefill:
            self.speculator.record_step(len(batch.seqs), drafts is not None, time.perf_counter() - start,
                                        steps, verified=result.verified)
        self.stats_.record_step(batch)
        return finished

    def rollout(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                *, use_tqdm: bool = False) -> RolloutBatch:
        """`generate`, then pack prompt + completions as padded arrays for a policy-gradient loss."""
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return build_rollout_batch(outputs, pad_id=pad_id, policy_version=self.policy_version)

    def sync_weights(self, params: object, mapping: str | tuple | list | None = None, *,
                     version: int | None = None, check_finite: bool = False,
                     draft_params: object | None = None, draft_mapping: str | tuple | list | None = None) -> None:
        """Put new policy parameters into the engine in place: no reload, no recompilation.

        `params` is the trainer's pytree: an `nnx.State` of this model class (mapping None), HF
        names and `[out, in]` layouts (mapping "hf"), or any tree with a `weight_sync` rule list.
        `draft_params`: new EAGLE-3 head weights in the same call (an `nnx.State` of the head, or the
        published layout with `draft_mapping="eagle3-hf"`); the head's shared embedding / lm_head
        are the policy's own arrays, so they follow `params` without being passed.
        Everything is validated first (one error lists every problem, weights untouched). The KV
        cache allocation is kept; cached prefixes are dropped (their K/V came from old weights).
        Outputs record `version` (default: previous version + 1) as their `policy_version`.
        """
        if self._generating:
            raise RuntimeError("sync_weights() was called while generate() is running; "
                               "call it between generate()/rollout() calls")
        drafter = self.runner.drafter
        if draft_params is not None and drafter is None:
            raise ValueError("draft_params were given but this engine has no EAGLE-3 head "
                             "(build it with speculative=Eagle3Config(...))")
        try:
            takes = self._head_takes()  # trainer-layout attention tensors into padded / replicated heads
            plan = weight_sync.plan(params, self.runner.params, mapping, takes=takes)  # cached per structure
            draft_plan = None if draft_params is None else weight_sync.plan(draft_params, drafter.params, draft_mapping)
        except weight_sync.WeightSyncError as err:
            problems = list(err.problems)
            if check_finite:  # one error lists every problem: the NaN/Inf sources too
                try:
                    src = weight_sync.flatten(params, what="source")
                    reject_non_finite(src, [p for p, x in zip(src.paths, src.leaves)
                                            if not isinstance(x, jax.ShapeDtypeStruct)])
                except weight_sync.WeightSyncError as nan_err:
                    problems += [p for p in nan_err.problems if p not in problems]
            raise weight_sync.WeightSyncError(problems) from None
        if draft_plan is not None:  # validate both before either is applied (apply checks only its own trees)
            draft_src = weight_sync.flatten(draft_params, what="source")
            flat = weight_sync.flatten
            problems = (weight_sync.abstract_leaves(flat(params, what="source"), flat(self.runner.params, what="target"))
                        + weight_sync.abstract_leaves(draft_src, flat(drafter.params, what="target")))
            if problems:
                raise weight_sync.WeightSyncError(problems)
            if check_finite:
                reject_non_finite(draft_src, sorted({p for op in draft_plan.ops for p in op.sources}))
        try:
            weight_sync.apply(plan, params, self.runner.params, check_finite=check_finite)
            if draft_plan is not None:
                weight_sync.apply(draft_plan, draft_params, drafter.params)
        finally:  # even a sync that failed part way (device memory) may have changed weights
            self.block_manager.invalidate_prefix_cache()
        self.policy_version = version if version is not None else (self.policy_version or 0) + 1
        self.stats_.num_weight_syncs += 1

    def _head_takes(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Per attention parameter, how the checkpoint layout expands into the stored heads (none
        unless the mesh needed padded or replicated heads); worked out once, the structure never changes."""
        if self._takes is None:
            layout = self.model_config.head_layout
            paths = weight_sync.flatten(self.runner.params, what="target").paths if layout is not None else []
            self._takes = {p: e for p in paths if (e := layout.expansion(p)) is not None}
        return self._takes

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (the next requests recompute their prompts)."""
        self.block_manager.invalidate_prefix_cache()

    @property
    def model(self) -> LlamaForCausalLM:
        """The model bound to the engine's current parameters (for a reference forward pass)."""
        return self.runner.model

    def warmup(self, *, prompt_logprobs: bool = False) -> int:
        """Compile every step bucket now (not during the first calls); returns the number of programs.

        Requests with `prompt_logprobs` use their own prefill programs: pass `prompt_logprobs=True`
        to compile those too.
        """
        spec = self.config.speculative
        return self.runner.warmup(prompt_logprobs=prompt_logprobs, speculative_k=spec.k if spec else 0,
                                  rejection=self._rejection)

    def stats(self) -> EngineStats:
        """Counters since the engine was built (a copy)."""
        return dataclasses.replace(
            self.stats_, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.block_manager.num_cache_hit_tokens,
            prefix_cache_queried_tokens=self.block_manager.num_cache_queried_tokens,
            num_compilations=num_compilations() - self._compiles_at_start,
            cpu_row_kernel=self.runner.row_kernel.reason, cpu_amx=self.runner.amx.reason,
            attention_impl=self.runner.attention_impl,
            speculative=dataclasses.replace(self.speculator.stats) if self.speculator is not None else None)

    # ---- internals --------------------------------------------------------------------------
    def _eagle_drafts(self, seqs: list[Sequence], limits: list[int]) -> list[np.ndarray]:
        """Placeholders for EAGLE-3 drafts (-1, as many as each sequence may take): the head makes them
        on the device in the verification step's own program (`StepBatch.draft_slots`)."""
        return [np.full(max(lim, 0), -1, np.int32) for lim in limits]

    def _add_request(self, prompt: str | None, ids: list[int], sp: SamplingParams
                     ) -> tuple[int, str | None, list[Sequence]]:
        rid = self._next_id
        self._next_id += 1
        seed = sp.seed if sp.seed is not None else int(self.rng.integers(0, 2**32))
        seqs = []
        for index in range(sp.n):
            seq = Sequence(seq_id=rid * 1_000_003 + index, request_id=rid, sample_index=index, prompt_ids=ids,
                           params=sp, seed=seed, arrival=self._next_arrival())
            self.scheduler.add(seq)
            seqs.append(seq)
        return rid, prompt, seqs

    def _next_arrival(self) -> int:
        self.stats_.num_sequences += 1
        return self.stats_.num_sequences
