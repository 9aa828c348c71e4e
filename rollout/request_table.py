"""`RequestTable`: the engine core's requests by id. Adding one (validated first) queues its n sequences;
aborting ends its unfinished ones at once; resuming continues an ended one; `report` builds the outputs a
step returns for the requests it touched and forgets those that ended (the last `NUM_RESUMABLE` stay
resumable)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import numpy as np

from rollout.outputs import RequestOutput
from rollout.request import Request, request_output
from rollout.request_validation import Prompt, RequestLimits, bad_words_token_ids, prompt_token_ids
from rollout.sampling_params import SamplingParams
from rollout.scheduler import Scheduler
from rollout.sequence import Sequence
from rollout.tokenizer import Tokenizer

NUM_RESUMABLE = 4096  # ended requests kept (newest first) so that `resume` can continue them


class RequestTable:
    """Unfinished requests (and finished ones not yet reported) by id, over the scheduler's queue."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, limits: RequestLimits, seed: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.rng = np.random.default_rng(seed)
        self.requests: dict[str, Request] = {}
        self._ended: OrderedDict[str, Request] = OrderedDict()  # the last NUM_RESUMABLE ended requests
        self._auto_ids = itertools.count()
        self._seq_ids = itertools.count()
        self.num_sequences = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[str]:
        return iter(self.requests)

    def __getitem__(self, request_id: str) -> Request:
        return self.requests[request_id]

    def prompt_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a `ValueError` saying what is wrong (nothing changes)."""
        return prompt_token_ids(prompt, params, self.tokenizer, self.limits)

    def new_id(self, request_id: str | None) -> str:
        """`request_id` checked (a non-empty string not in use), or a fresh one for None."""
        if request_id is None:
            while (request_id := str(next(self._auto_ids))) in self.requests:
                pass
            return request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; abort it or pick another id")
        return request_id

    def add(self, prompt: str | None, ids: list[int], sp: SamplingParams, request_id: str,
            policy_version: int | None) -> str:
        """Queue a validated request's n sequences (`policy_version`: the weights in force, its lag's start)."""
        if sp.max_tokens is None:  # vLLM's meaning: as many as the context leaves
            sp = dataclasses.replace(sp, max_tokens=self.limits.max_model_len - len(ids))
        if sp.logprobs == -1 or sp.prompt_logprobs == -1:  # vLLM's meaning: the whole vocabulary
            vocab = self.limits.vocab_size
            sp = dataclasses.replace(sp, logprobs=vocab if sp.logprobs == -1 else sp.logprobs,
                                     prompt_logprobs=vocab if sp.prompt_logprobs == -1 else sp.prompt_logprobs)
        bad_word_ids = bad_words_token_ids(sp.bad_words, self.tokenizer) if sp.bad_words else ()
        seed = sp.seed if sp.seed is not None else int(self.rng.integers(0, 2**32))
        seqs = []
        for index in range(sp.n):
            self.num_sequences += 1
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, sample_index=index, prompt_ids=ids,
                           params=sp, seed=seed, arrival=self.num_sequences)
            seq.admitted_version = policy_version
            seq.rows.bad_word_ids = bad_word_ids
            self.scheduler.add(seq)
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, prompt, sp, seqs)
        return request_id

    def abort(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now (blocks freed, unfinished samples with `finish_reason="abort"`); each one's final
        output. Ids unknown or already reported finished are ignored (as vLLM)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        results = []
        for rid in dict.fromkeys(ids):
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            unfinished = [s for s in req.seqs if not s.is_finished]
            self.scheduler.abort(unfinished)
            for seq in unfinished:
                seq.out.finish_reason = "abort"
            self.forget(req)
            results.append(request_output(req, self.tokenizer, kind="cumulative"))
        return results

    def resume(self, request_id: str, params: SamplingParams | None = None) -> str:
        """Continue an ended request whose samples were aborted or cut by `max_tokens` (`Engine.resume`)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} has not ended; abort it first or wait for its last output")
        req = self._ended.get(request_id)
        if req is None:
            raise ValueError(f"no ended request {request_id!r} to resume (only the last {NUM_RESUMABLE} ended ones "
                             "are kept); add its prompt + completion ids as a new prompt instead")
        seqs = [s for s in req.seqs if s.out.finish_reason in ("abort", "length")]
        sp = req.params if params is None else params
        extra = {s.seq_id: (req.params.max_tokens - s.num_output_tokens if params is None else sp.max_tokens
                            if sp.max_tokens is not None else self.limits.max_model_len - s.num_tokens) for s in seqs}
        seqs = [s for s in seqs if extra[s.seq_id] > 0]
        if not seqs:
            raise ValueError(f"request {request_id!r} has no sample to continue (each stopped on a stop rule or "
                             "used its max_tokens); pass SamplingParams with the max_tokens to add")
        for seq in seqs:
            self.prompt_ids(seq.token_ids, sp)  # raises before anything changes
        del self._ended[request_id]
        for seq in seqs:
            seq.params = dataclasses.replace(sp, max_tokens=seq.num_output_tokens + extra[seq.seq_id])
            seq.reset_for_resume()
            self.scheduler.mark_prefilled(seq)  # its prompt is not shared anew: each sample recomputes its own
            self.scheduler.add(seq)
            req.sent_final[seq.sample_index] = False
        self.requests[request_id] = req
        return request_id

    def forget(self, req: Request) -> None:
        """A request's last output is out: drop it from the table, keep it resumable."""
        self.requests.pop(req.request_id, None)
        self.scheduler.forget_request(req.request_id)
        self._ended[req.request_id] = req
        self._ended.move_to_end(req.request_id)
        while len(self._ended) > NUM_RESUMABLE:
            self._ended.popitem(last=False)

    def report(self, seqs: Iterable[Sequence]) -> list[RequestOutput]:
        """Outputs of the requests these sequences belong to (as their `output_kind` says); finished
        requests are forgotten. A final-only request reports nothing until its sequences end: only those
        with one that ended are read."""
        results = []
        touched = (s.request_id for s in seqs if s.is_finished or s.params.output_kind != "final_only")
        for rid in dict.fromkeys(touched):
            req = self.requests.get(rid)
            if req is None:
                continue
            out = request_output(req, self.tokenizer)
            if out is not None:
                results.append(out)
            if req.finished:
                self.forget(req)
        return results

    def report_finished(self) -> list[RequestOutput]:
        """The cumulative outputs of every request whose sequences all ended outside a step (forgotten)."""
        results = []
        for req in [r for r in self.requests.values() if r.finished]:
            results.append(request_output(req, self.tokenizer, kind="cumulative"))
            self.forget(req)
        return results
