"""`EngineCore`: the engine's request table and its step (schedule -> run -> postprocess).

The core owns requests, not calls: `add_request` queues one (validated first), `step` advances every
queued and running request by one device call and reports the requests that changed, `abort` ends
requests at once (their KV blocks freed), and `sync_weights` may run between any two steps. Every
generated token records the policy version that sampled it. `Engine` (rollout/engine.py) builds the
core and adds the blocking clients `generate` / `rollout` over this API.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from rollout.block_manager import BlockManager
from rollout.engine_config import EngineConfig, EngineStats
from rollout.output_processor import OutputProcessor
from rollout.outputs import RequestOutput
from rollout.policy_sync import PolicyUpdates, WeightUpdater
from rollout.request import Request, request_output
from rollout.request_validation import Prompt, RequestLimits, bad_words_token_ids, prompt_token_ids
from rollout.routing_record import RoutingRecord
from rollout.sampling_params import SamplingParams
from rollout.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from rollout.sequence import Sequence
from rollout.speculator import Speculator, device_draft_slots
from rollout.step_builder import build_ahead_step, build_step
from rollout.tokenizer import Tokenizer
from runner.model_runner import ModelRunner, PendingStep, StepBatch
from runner.spec_decode.eagle3_config import Eagle3Config

NUM_RESUMABLE = 4096  # ended requests kept (newest first) so that `resume` can continue them

class EngineCore(PolicyUpdates):
    """A request table over the scheduler, the KV block manager and the model runner (weight syncs:
    `rollout.policy_sync.PolicyUpdates`)."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = eos_token_ids
        spec, kv_spec = config.speculative, runner.kv_spec
        self._limits = RequestLimits(
            runner.config.vocab_size, config.max_model_len, config.max_logprobs, eos_token_ids,
            max_kept_ids=config.max_kept_ids,
            processors="an EAGLE-3 engine's draft programs do not apply them" if runner.drafter is not None else "")
        self.block_manager = BlockManager(kv_spec.num_blocks, kv_spec.block_size, num_replicas=kv_spec.num_replicas,
                                          enable_prefix_caching=config.enable_prefix_caching)
        if runner.record_routing:
            self.block_manager.routing = RoutingRecord.for_model(runner.config, kv_spec.num_blocks, kv_spec.block_size)
        self.speculator = None if spec is None else Speculator(
            spec, config.max_model_len, config.max_num_batched_tokens,
            draft_fn=device_draft_slots if runner.drafter is not None else None)
        self._rejection = spec is not None and spec.verification == "rejection"
        verify_steps = spec.num_verify_steps if isinstance(spec, Eagle3Config) else 1
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.max_model_len,
                                                   decode_steps=(1 + (spec.k if spec else 0)) * verify_steps,
                                                   num_replicas=kv_spec.num_replicas,
                                                   num_scheduler_steps=config.num_scheduler_steps),
                                   self.block_manager)
        self.outputs = OutputProcessor(self.scheduler, tokenizer, eos_token_ids, config.max_model_len)
        self.rng = np.random.default_rng(config.seed)
        self.weights = WeightUpdater(runner)
        self.stats_ = EngineStats()
        self.requests: dict[str, Request] = {}  # unfinished requests, and finished ones not yet reported
        self._ended: OrderedDict[str, Request] = OrderedDict()  # the last NUM_RESUMABLE ended requests
        self._deferred: list[RequestOutput] = []  # outputs a blocking client stepped past (see `generate`)
        # a decode call launched ahead (async scheduling), with the inputs it was launched with
        self._ahead: tuple[ScheduledBatch, PendingStep, StepBatch] | None = None
        self._in_step = False  # a step is running: weights may not change under it
        self._auto_ids = itertools.count()
        self._seq_ids = itertools.count()
        self._first_version: int | None = None  # the policy version lag-aware admission counts from
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
        ids = prompt_token_ids(prompt, params, self.tokenizer, self._limits)
        request_id = self._check_request_id(request_id)
        return self._add(prompt if isinstance(prompt, str) else None, ids, params, request_id)

    def check_request(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or the `ValueError` `add_request` would raise (nothing is queued)."""
        return prompt_token_ids(prompt, params, self.tokenizer, self._limits)

    def _check_request_id(self, request_id: str | None) -> str:
        if request_id is None:
            while (request_id := str(next(self._auto_ids))) in self.requests:
                pass
            return request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; abort it or pick another id")
        return request_id

    def _add(self, prompt: str | None, ids: list[int], sp: SamplingParams, request_id: str) -> str:
        if self.runner.released:
            raise RuntimeError("the engine is asleep (sleep() freed its KV cache): call wake() first")
        if sp.max_tokens is None:  # vLLM's meaning: as many as the context leaves
            sp = dataclasses.replace(sp, max_tokens=self.config.max_model_len - len(ids))
        if sp.logprobs == -1 or sp.prompt_logprobs == -1:  # vLLM's meaning: the whole vocabulary
            vocab = self.runner.config.vocab_size
            sp = dataclasses.replace(sp, logprobs=vocab if sp.logprobs == -1 else sp.logprobs,
                                     prompt_logprobs=vocab if sp.prompt_logprobs == -1 else sp.prompt_logprobs)
        bad_word_ids = bad_words_token_ids(sp.bad_words, self.tokenizer) if sp.bad_words else ()
        seed = sp.seed if sp.seed is not None else int(self.rng.integers(0, 2**32))
        seqs = []
        for index in range(sp.n):
            self.stats_.num_sequences += 1
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, sample_index=index, prompt_ids=ids,
                           params=sp, seed=seed, arrival=self.stats_.num_sequences)
            seq.admitted_version = self.policy_version
            seq.bad_word_ids = bad_word_ids
            self.scheduler.add(seq)
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, prompt, sp, seqs)
        return request_id

    def abort(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now: their KV blocks are freed and their unfinished samples end with
        `finish_reason="abort"`. Returns each one's final output (all it produced). Ids that are
        unknown or already reported finished are ignored (as vLLM)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        results = []
        for rid in dict.fromkeys(ids):
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            unfinished = [s for s in req.seqs if not s.is_finished]
            self.scheduler.abort(unfinished)
            for seq in unfinished:
                seq.finish_reason = "abort"
            self._forget(req)
            results.append(request_output(req, self.tokenizer, kind="cumulative"))
        return results

    def resume(self, request_id: str, params: SamplingParams | None = None) -> str:
        """Continue an ended request whose samples were aborted or cut by `max_tokens`, under the weights
        in force now. Its computed prefix comes back from the prefix cache; the tokens so far are kept
        (their logprobs and policy versions too), and each such sample may generate `params.max_tokens`
        more (default: its original params and what was left of its `max_tokens`). Samples that stopped
        on a stop rule stay as they are. Returns the request id; its outputs carry the whole completion.
        The last NUM_RESUMABLE ended requests can be resumed; or add prompt + completion ids as a prompt."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} has not ended; abort it first or wait for its last output")
        req = self._ended.get(request_id)
        if req is None:
            raise ValueError(f"no ended request {request_id!r} to resume (only the last {NUM_RESUMABLE} ended ones "
                             "are kept); add its prompt + completion ids as a new prompt instead")
        seqs = [s for s in req.seqs if s.finish_reason in ("abort", "length")]
        sp = req.params if params is None else params
        extra = {s.seq_id: (req.params.max_tokens - s.num_output_tokens if params is None else sp.max_tokens
                            if sp.max_tokens is not None else self.config.max_model_len - s.num_tokens) for s in seqs}
        seqs = [s for s in seqs if extra[s.seq_id] > 0]
        if not seqs:
            raise ValueError(f"request {request_id!r} has no sample to continue (each stopped on a stop rule or "
                             "used its max_tokens); pass SamplingParams with the max_tokens to add")
        for seq in seqs:
            prompt_token_ids(seq.token_ids, sp, self.tokenizer, self._limits)  # raises before anything changes
        del self._ended[request_id]
        for seq in seqs:
            seq.params = dataclasses.replace(sp, max_tokens=seq.num_output_tokens + extra[seq.seq_id])
            seq.reset_for_resume()
            self.scheduler.mark_prefilled(seq)  # its prompt is not shared anew: each sample recomputes its own
            self.scheduler.add(seq)
            req.sent_final[seq.sample_index] = False
        self.requests[request_id] = req
        return request_id

    def _forget(self, req: Request) -> None:
        """A request's last output is out: drop it from the table, keep it resumable."""
        self.requests.pop(req.request_id, None)
        self.scheduler.forget_request(req.request_id)
        self._ended[req.request_id] = req
        self._ended.move_to_end(req.request_id)
        while len(self._ended) > NUM_RESUMABLE:
            self._ended.popitem(last=False)

    def has_unfinished_requests(self) -> bool:
        """True while some request is queued or running, or has outputs `step()` has not returned yet."""
        return self.scheduler.has_unfinished() or bool(self._deferred) or self._ahead is not None

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> run -> postprocess. Returns an output for each request that
        changed (as its `output_kind` says); a request's last output has `finished=True`, after which
        the request is forgotten. A step that raises aborts the requests it had scheduled.

        With `EngineConfig.async_scheduling`, a multi-step decode call launches the next one before its
        own tokens reach the host (the device feeds them), so the device runs while the host applies them.
        A call launched ahead whose sequences all ended meanwhile (a stop id or EOS the host had not seen)
        is collected at once: no request is left unfinished with a call in flight."""
        outputs = self._report(self._execute(overlap=self.config.async_scheduling))
        if self._ahead is not None and all(s.is_finished for s in self._ahead[0].seqs):
            self._drain()
            outputs, self._deferred = outputs + self._deferred, []
        return outputs

    def _report(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Outputs of the requests `batch` touched (and any deferred ones); finished requests are forgotten."""
        results, self._deferred = self._deferred, []
        # a final-only request reports nothing until its sequences end: only those with one that ended are read
        touched = (s.request_id for s in batch.seqs if s.is_finished or s.params.output_kind != "final_only")
        for rid in dict.fromkeys(touched):
            req = self.requests.get(rid)
            if req is None:
                continue
            out = request_output(req, self.tokenizer)
            if out is not None:
                results.append(out)
            if req.finished:
                self._forget(req)
        return results

    def _drain(self) -> None:
        """Finish the call launched ahead, if any (before weights change); its outputs wait for `step()`."""
        if self._ahead is not None:
            self._deferred = self._report(self._execute(overlap=False))

    def _execute(self, overlap: bool) -> ScheduledBatch:
        ahead, self._ahead = self._ahead, None
        batch, pending, step = ahead if ahead is not None else (self.scheduler.schedule(), None, None)
        if not batch.seqs:  # nothing to run (no requests): no device call
            return batch
        self._in_step = True
        try:
            start = time.perf_counter()
            self._run(batch, pending, step, overlap)
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

    def _run(self, batch: ScheduledBatch, pending: PendingStep | None, step: StepBatch | None, overlap: bool) -> None:
        drafts = None
        start = time.perf_counter()  # a speculative step's time includes drafting (n-gram lookup, EAGLE head)
        before = self.outputs.num_generated
        if self.speculator is not None and pending is None:  # (no call is launched ahead with a speculator)
            batch, drafts = self.speculator.propose(batch)
        if pending is None:
            step = build_step(batch, self.eos_token_ids, drafts, rejection=self._rejection,
                              multi_step=self.config.num_scheduler_steps > 1, device_drafts=self.runner.drafter is not None)
            pending = self.runner.launch(step)
        # (a call launched ahead would not see the tokens its penalties and bad words must read)
        if overlap and pending.last_tokens is not None and drafts is None and not any(
                s.reads_output for s in batch.seqs):
            planned = self.scheduler.schedule_ahead(batch)
            if planned is not None:
                nxt, kept = planned
                ahead_step = build_ahead_step(step, nxt, kept, pending.rows[kept], self.eos_token_ids)
                self._ahead = (nxt, self.runner.launch(ahead_step, after=pending), ahead_step)
                self.stats_.num_ahead_calls += 1
        result = self.runner.collect(pending)
        records, steps_run = self.outputs.apply(batch, result, drafts)
        steps = float(np.mean(batch.num_new_tokens)) if drafts is None or result.steps == 1 else float(steps_run)
        if drafts is not None and result.verified:
            for seq, drafted, accepted in records:
                self.speculator.record_acceptance(seq, drafted, accepted, accepted + 1, self.policy_version)
            if result.steps > 1:
                self.speculator.record_verify_steps(steps_run)
        elif drafts is not None:  # the head was unsure: the device decoded this step plainly
            self.speculator.record_unsure(batch.seqs)
        if self.speculator is not None and not batch.is_prefill:
            self.speculator.record_step(len(batch.seqs), drafts is not None, time.perf_counter() - start,
                                        steps, verified=result.verified)
        self.stats_.record_step(batch)
        self.stats_.generated_tokens += self.outputs.num_generated - before
