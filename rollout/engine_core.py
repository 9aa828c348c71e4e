"""`EngineCore`: the engine's request table and its step (schedule -> run -> postprocess), and weight syncs
between steps.

The core owns requests, not calls: `add_request` queues one (validated first), `step` advances every
queued and running request by one device call and reports the requests that changed, `abort` ends
requests at once (their KV blocks freed), and `sync_weights` may run between any two steps. Every
generated token records the policy version that sampled it. `rollout.engine.Engine` holds a core and
adds the blocking clients `generate` / `rollout` over this API.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import numpy as np

from rollout import policy_lag
from rollout.block_manager import BlockManager
from rollout.engine_config import EngineConfig, EngineStats
from rollout.output_processor import OutputProcessor
from rollout.outputs import RequestOutput
from rollout.plan_builder import ahead_plan, build_plan
from rollout.request_table import RequestTable
from rollout.request_validation import Prompt, RequestLimits
from rollout.routing_record import RoutingRecord
from rollout.sampling_params import SamplingParams
from rollout.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from rollout.speculator import Speculator, device_draft_slots
from rollout.tokenizer import Tokenizer
from rollout.weight_updates import WeightUpdates
from weight_sync.compiles import num_compilations
from runner.model_runner import ModelRunner
from runner.spec_decode.eagle3_config import Eagle3Config
from runner.step_plan import StepPlan
from runner.step_result import PendingStep


class EngineCore:
    """A request table over the scheduler, the KV block manager and the model runner."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.runner, self.tokenizer, self.config, self.eos_token_ids = runner, tokenizer, config, eos_token_ids
        spec, kv_spec = config.speculative, runner.kv_spec
        self.block_manager = BlockManager(kv_spec.num_blocks, kv_spec.block_size, num_replicas=kv_spec.num_replicas,
                                          enable_prefix_caching=config.enable_prefix_caching)
        if runner.record_routing:
            self.block_manager.routing = RoutingRecord(kv_spec.num_blocks, kv_spec.block_size,
                                                       len(runner.config.moe_layers), runner.config.num_experts_per_tok)
        self.speculator = None if spec is None else Speculator(
            spec, config.max_model_len, config.max_num_batched_tokens,
            draft_fn=device_draft_slots if runner.drafter is not None else None)
        self._rejection = spec is not None and spec.verification == "rejection"
        verify_steps = spec.num_verify_steps if isinstance(spec, Eagle3Config) else 1
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
            decode_steps=(1 + (spec.k if spec else 0)) * verify_steps, num_replicas=kv_spec.num_replicas,
            num_scheduler_steps=config.num_scheduler_steps, interleave_decodes=spec is not None), self.block_manager)
        limits = RequestLimits(
            runner.config.vocab_size, config.max_model_len, config.max_logprobs, eos_token_ids,
            max_kept_ids=config.max_kept_ids,
            processors="an EAGLE-3 engine's draft programs do not apply them" if runner.drafter is not None else "")
        self.requests = RequestTable(self.scheduler, tokenizer, limits, config.seed)
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, config.max_model_len, self.block_manager.routing)
        self.weights = WeightUpdates(runner)
        self.stats_ = EngineStats()
        self._deferred: list[RequestOutput] = []  # outputs a blocking client stepped past (`Engine.generate`)
        # a decode loop launched ahead (async scheduling), with the plan it was launched with
        self._ahead: tuple[ScheduledBatch, PendingStep, StepPlan] | None = None
        self._in_step = False  # a step is running: weights may not change under it
        self._first_version: int | None = None  # the policy version lag-aware admission counts from
        self._compiles_at_start = num_compilations()
        self._update_admission()

    @property
    def policy_version(self) -> int | None:
        """The version of the weights in force (None until the first `sync_weights`)."""
        return self.outputs.policy_version

    @policy_version.setter
    def policy_version(self, version: int | None) -> None:
        self.outputs.policy_version = version
        self._update_admission()

    def _update_admission(self) -> None:
        """Lag-aware admission (`EngineConfig.samples_per_version`): at most (versions since the engine
        began + max_policy_lag + 1) batches of samples may have started."""
        per_version = self.config.samples_per_version
        if per_version is None:
            return
        if self._first_version is None:
            self._first_version = self.policy_version or 0
        versions = (self.policy_version or 0) - self._first_version
        self.scheduler.admission_limit = (versions + self.config.max_policy_lag + 1) * per_version

    def admission_held(self) -> bool:
        """Every unfinished sample waits for a new policy version (lag-aware admission): `step()` has
        nothing to run until `sync_weights`."""
        return not self._deferred and self._ahead is None and self.scheduler.admission_held

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); returns its request id (made when none is given).

        Raises `ValueError` before anything is queued if the prompt, the params or the id is bad."""
        params = SamplingParams() if params is None else params
        ids = self.requests.prompt_ids(prompt, params)
        return self.add_checked(prompt if isinstance(prompt, str) else None, ids, params,
                                self.requests.new_id(request_id))

    def add_checked(self, prompt: str | None, ids: list[int], params: SamplingParams, request_id: str) -> str:
        """Queue a request whose ids and request id are already checked (`RequestTable.prompt_ids`, `new_id`)."""
        if self.runner.released:
            raise RuntimeError("the engine is asleep (sleep() freed its KV cache): call wake() first")
        return self.requests.add(prompt, ids, params, request_id, self.policy_version)

    def abort(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now: their KV blocks are freed and their unfinished samples end with
        `finish_reason="abort"`. Returns each one's final output (all it produced). Ids that are
        unknown or already reported finished are ignored (as vLLM)."""
        return self.requests.abort(request_ids)

    def resume(self, request_id: str, params: SamplingParams | None = None) -> str:
        """Continue an ended request whose samples were aborted or cut by `max_tokens`, under the weights
        in force now. Its computed prefix comes back from the prefix cache; the tokens so far are kept
        (their logprobs and policy versions too), and each such sample may generate `params.max_tokens`
        more (default: its original params and what was left of its `max_tokens`). Samples that stopped
        on a stop rule stay as they are. Returns the request id; its outputs carry the whole completion.
        The last NUM_RESUMABLE ended requests can be resumed; or add prompt + completion ids as a prompt."""
        return self.requests.resume(request_id, params)

    def has_unfinished_requests(self) -> bool:
        """True while some request is queued or running, or has outputs `step()` has not returned yet."""
        return self.scheduler.has_unfinished() or bool(self._deferred) or self._ahead is not None

    def defer(self, outputs: list[RequestOutput]) -> None:
        """Outputs a blocking client stepped past: the next `step()` returns them."""
        self._deferred += outputs

    def drop_deferred(self, request_ids: set[str]) -> None:
        """Forget the deferred outputs of these requests (a blocking client's call that failed)."""
        self._deferred = [o for o in self._deferred if o.request_id not in request_ids]

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> run -> postprocess. Returns an output for each request that
        changed (as its `output_kind` says); a request's last output has `finished=True`, after which
        the request is forgotten. A step that raises aborts the requests it had scheduled.

        With `EngineConfig.async_scheduling`, a decode loop launches the next one before its own tokens
        reach the host (the device feeds them), so the device runs while the host applies them. A loop
        launched ahead whose sequences all ended meanwhile (a stop id or EOS the host had not seen) is
        collected at once: no request is left unfinished with a call in flight. Raises
        `SharedWeightsDeleted` before anything runs if the trainer deleted arrays the engine shares."""
        self.runner.weights.check()
        batch = self._execute(overlap=self.config.async_scheduling)
        outputs, self._deferred = self._deferred + self.requests.report(batch.seqs), []
        if self._ahead is not None and all(s.is_finished for s in self._ahead[0].seqs):
            self._drain()
            outputs, self._deferred = outputs + self._deferred, []
        return outputs

    def _drain(self) -> None:
        """Finish the call launched ahead, if any (before weights change); its outputs wait for `step()`."""
        if self._ahead is not None:
            self._deferred += self.requests.report(self._execute(overlap=False).seqs)

    def _execute(self, overlap: bool) -> ScheduledBatch:
        ahead, self._ahead = self._ahead, None
        batch, pending, plan = ahead if ahead is not None else (self.scheduler.schedule(), None, None)
        if not batch.seqs:  # nothing to run (no requests): no device call
            return batch
        self._in_step = True
        try:
            start = time.perf_counter()
            self._run(batch, pending, plan, overlap)
        except BaseException:
            seqs = batch.seqs + (self._ahead[0].seqs if self._ahead is not None else [])
            self._ahead = None
            self._deferred += self.abort(dict.fromkeys(s.request_id for s in seqs))
            # the step's blocks were published for prefix sharing when scheduled, maybe never computed
            self.block_manager.invalidate_prefix_cache()
            raise
        finally:
            self._in_step = False
        self.stats_.generate_seconds += time.perf_counter() - start
        return batch

    def _run(self, batch: ScheduledBatch, pending: PendingStep | None, plan: StepPlan | None, overlap: bool) -> None:
        """Plan and launch `batch` (unless it was launched ahead), launch the next decode loop ahead where it
        can be, then collect `batch` and apply its results."""
        drafts = None
        start = time.perf_counter()  # a speculative step's time includes drafting (n-gram lookup, EAGLE head)
        if self.speculator is not None and pending is None:  # (no call is launched ahead with a speculator)
            batch, drafts = self.speculator.propose(batch)
        if pending is None:
            plan = build_plan(batch, self.eos_token_ids, drafts, rejection=self._rejection,
                              device_drafts=self.runner.drafter is not None)
            pending = self.runner.launch(plan)
        # (a call launched ahead would not see the tokens its penalties and bad words must read)
        if overlap and pending.last_tokens is not None and not any(s.reads_output for s in batch.seqs):
            planned = self.scheduler.schedule_ahead(batch)
            if planned is not None:
                nxt, kept = planned
                ahead = ahead_plan(plan, nxt, kept, pending.rows[kept])
                self._ahead = (nxt, self.runner.launch(ahead, after=pending), ahead)
                self.stats_.num_ahead_calls += 1
        result = self.runner.collect(pending)
        outcome = self.outputs.apply(plan, batch, result, drafts)
        for seq in outcome.prefilled:  # its prompt's K/V is complete: its sibling samples may share it
            self.scheduler.mark_prefilled(seq)
        for seq in outcome.finished:
            self.scheduler.finish(seq)
        if self.speculator is not None and plan.kind != "ragged":
            steps = float(np.mean(batch.num_new_tokens)) if plan.kind == "decode_loop" else outcome.num_steps_run
            self.speculator.record(plan.kind, batch.seqs, outcome.drafts, result.verified, self.policy_version,
                                   seconds=time.perf_counter() - start, num_steps=steps)
        self.stats_.record_step(plan.kind, batch)
        self.stats_.generated_tokens += outcome.num_generated

    # ---- weights ------------------------------------------------------------------------------
    def sync_weights(self, params: object, mapping: str | tuple | list | None = None, *,
                     version: int | None = None, check_finite: bool = False,
                     draft_params: object | None = None, draft_mapping: str | tuple | list | None = None,
                     recompute_running: bool = False, share_weights: bool | None = None) -> None:
        """Put new policy parameters into the engine in place: no reload, no recompilation. Legal
        between any two steps, with requests running.

        `params` is the trainer's pytree: an `nnx.State` of this model class (mapping None), HF
        names and `[out, in]` layouts (mapping "hf"), or any tree with a `weight_sync` rule list.
        `draft_params`: new EAGLE-3 head weights in the same call (an `nnx.State` of the head, or the
        published layout with `draft_mapping="eagle3-hf"`); the head's shared embedding / lm_head
        are the policy's own arrays, so they follow `params` without being passed.
        Everything is validated first (one error lists every problem, weights untouched). The KV
        cache allocation is kept; cached prefixes are dropped (their K/V came from old weights).
        Running requests go on under the new weights: by default they keep the K/V computed so far
        (PipelineRL's in-flight update); `recompute_running=True` recomputes it under the new weights
        first (their tokens so far are kept). Tokens sampled from now on record `version` (default:
        previous version + 1). `EngineConfig.max_policy_lag` then aborts (or recomputes) samples that
        began too many versions ago; their outputs wait for `step()`. `share_weights` (default
        `EngineConfig.share_weights`): arrays already laid out as the engine's (same path, shape, dtype and
        sharding) become the engine's without a copy (a reference swap; packed copies are recomputed).
        """
        if self._in_step:
            raise RuntimeError("sync_weights() was called inside an engine step (while generate() is running "
                               "one, say); call it between steps")
        if self.runner.released:
            raise RuntimeError("sync_weights() while the engine is asleep: call wake() first")
        share = self.config.share_weights if share_weights is None else share_weights
        checked = self.weights.check(params, mapping, check_finite=check_finite, draft_params=draft_params,
                                     draft_mapping=draft_mapping, share=share)
        self._drain()  # tokens of a call launched ahead were sampled under the old weights
        try:
            self.weights.write(checked, draft_params, check_finite=check_finite, share=share)
        finally:  # even a sync that failed part way (device memory) may have changed weights
            self.block_manager.invalidate_prefix_cache()
        self.policy_version = version if version is not None else (self.policy_version or 0) + 1
        if recompute_running:
            policy_lag.recompute_running(self.scheduler, self.policy_version)
        self.stats_.num_weight_syncs += 1
        if self.config.max_policy_lag is not None:
            recompute = self.config.policy_lag_action == "recompute"
            aborted, recomputed = policy_lag.bound_lag(self.scheduler, self.policy_version,
                                                       self.config.max_policy_lag, recompute)
            for seq in aborted:
                seq.out.finish_reason = "abort"
            self.stats_.num_lag_aborts += len(aborted)
            self.stats_.num_lag_recomputes += recomputed
            self._deferred += self.requests.report_finished()

    def stats(self) -> EngineStats:
        """Counters since the engine was built (a copy), with the backend's kernel choices."""
        backend, memory = self.runner.backend.status(), self.runner.memory()
        return dataclasses.replace(
            self.stats_, num_sequences=self.requests.num_sequences, num_preemptions=self.scheduler.num_preemptions,
            num_lag_held=self.scheduler.num_held, prefix_cache_hit_tokens=self.block_manager.num_cache_hit_tokens,
            prefix_cache_queried_tokens=self.block_manager.num_cache_queried_tokens,
            num_compilations=num_compilations() - self._compiles_at_start,
            backend=backend.name, cpu_row_kernel=backend.matmul, cpu_amx=backend.amx, attention_impl=backend.attention,
            cpu_bf16_matmul=backend.bf16_matmul, batch_invariant=backend.batch_invariant,
            attention_kernel=backend.attention_kernel, weight_bytes_shared=memory.weights_shared,
            weight_bytes_held=memory.weights_held, kv_cache_bytes=memory.kv_cache, program_bytes=memory.programs,
            speculative=dataclasses.replace(self.speculator.stats) if self.speculator is not None else None)
