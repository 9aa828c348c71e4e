"""`StepPlan`: one engine step as a typed plan of exact-size host arrays (numpy, no JAX).

Its `kind` is the only thing the runner (`runner.plan_programs.PROGRAMS`: bucket shape and program),
the padding (`runner.step_padding`) and the engine's output processing dispatch on:

| kind | what the step does | rows sampled |
| --- | --- | --- |
| `ragged` | every sequence computes `q_len` of its pending tokens: one for a running decode, a chunk of a prompt (new, resumed, preempted) otherwise; all in one ragged program | after each sequence's last token (kept where it reaches the sequence's end) |
| `decode_loop` | every sequence decodes `loop.num_steps` tokens in one device loop, each sampled token fed back | one per sequence and step |
| `verify` | each sequence feeds its last token and drafts (made on the host, or by the EAGLE-3 head in the program) | one per fed token |
| `verify_loop` | up to `loop.num_steps` draft-verify steps in one device loop (EAGLE-3, exact replay) | one per fed token and step |

Inputs are nested by concern: `tokens` (what attention and the KV writes read), `sampling` (how rows
sample), `loop` (device loops: steps, `min_tokens`, stop ids) and `drafts` (verification). Each has
one constructor per kind (`StepPlan.ragged`, ...), which checks what the kind needs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
from jaxtyping import Bool, Int

from runner.logits_processors import AdjustRows
from runner.sampling_rows import SAMPLER_MODES, SamplingRows, choose_mode

PlanKind = Literal["ragged", "decode_loop", "verify", "verify_loop"]
PLAN_KINDS: tuple[PlanKind, ...] = ("ragged", "decode_loop", "verify", "verify_loop")
MAX_SUPPRESS = 8  # ids a request may forbid per step (EOS + stop ids before min_tokens)


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """The step's tokens packed by sequence (S sequences, T tokens)."""

    token_ids: Int[np.ndarray, "T"]  # tokens whose K/V this step computes
    positions: Int[np.ndarray, "T"]
    q_lens: Int[np.ndarray, "S"]  # tokens of each sequence in this step
    kv_lens: Int[np.ndarray, "S"]  # context length of each sequence after this step
    block_tables: list[list[int]]  # [S][blocks] KV blocks of each sequence (global ids)
    replicas: Int[np.ndarray, "S"] | None = None  # data-parallel replica of each sequence; None = all on 0
    target_ids: Int[np.ndarray, "T"] | None = None  # next token of each position: asks for prompt logprobs

    def select(self, seq_mask: Bool[np.ndarray, "S"], token_mask: Bool[np.ndarray, "T"], block_offset: int
               ) -> "TokenInputs":
        """The sequences of `seq_mask` (their tokens: `token_mask`), block ids made local to a replica."""
        return TokenInputs(
            self.token_ids[token_mask], self.positions[token_mask], self.q_lens[seq_mask], self.kv_lens[seq_mask],
            [[b - block_offset for b in t] for t, m in zip(self.block_tables, seq_mask) if m], None,
            None if self.target_ids is None else self.target_ids[token_mask])


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """How each of the N sampled rows samples, and what the step returns of it."""

    rows: SamplingRows  # [N]
    suppress_ids: Int[np.ndarray, "N M"]  # ids forbidden this step (min_tokens), -1 = none
    adjust: AdjustRows | None = None  # [N] logits processors; None: no row uses one
    num_top_logprobs: int = 0
    sampling_record: bool = False  # also each row's kept mass and kept ids (`runner.sampler.SamplerOutput`)

    def take(self, index: Int[np.ndarray, "K"]) -> "SamplingPlan":
        return dataclasses.replace(self, rows=self.rows.take(index), suppress_ids=self.suppress_ids[index],
                                   adjust=None if self.adjust is None else self.adjust.take(index))

    @property
    def mode(self) -> int:
        """The sampler variant of the step (index into `SAMPLER_MODES`): filters count only in rows that
        sample or want processed logprobs (a sampling record describes the processed distribution)."""
        r = self.rows
        processed = r.processed | self.sampling_record
        return SAMPLER_MODES.index(choose_mode(r.temperature, r.top_k, r.top_p, r.min_p, processed=processed))


@dataclasses.dataclass(frozen=True)
class LoopInputs:
    """Per sampled row, what a device loop needs (`decode_loop`, `verify_loop`); padding rows run 0 steps."""

    num_steps: Int[np.ndarray, "N"]  # steps of the row's sequence in this call (>= 1)
    suppress_steps: Int[np.ndarray, "N"]  # of those, how many keep `suppress_ids` forbidden (min_tokens)
    stop_ids: Int[np.ndarray, "N M"]  # ids that end the sequence (EOS, stop ids), -1 = none
    # a decode loop launched before the previous call's tokens reached the host: the flat output row of
    # each sequence in the previous call, whose last token is its input; None: `tokens.token_ids` as given
    feed_rows: Int[np.ndarray, "N"] | None = None

    def take(self, index: Int[np.ndarray, "K"]) -> "LoopInputs":
        return LoopInputs(self.num_steps[index], self.suppress_steps[index], self.stop_ids[index],
                          None if self.feed_rows is None else self.feed_rows[index])


@dataclasses.dataclass(frozen=True)
class DraftInputs:
    """A verification step's drafts: each sequence's last token and drafts are fed, a row samples after each."""

    logits_indices: Int[np.ndarray, "N"]  # the packed token each sampled row samples after
    draft_ids: Int[np.ndarray, "N"] | None = None  # the draft each row verifies by rejection sampling (-1 none)
    # drafts the EAGLE-3 head makes in the same program: token t is its sequence's draft `draft_slots[t]`
    # (-1: `token_ids[t]` as given); the rows' `draft_ids` then follow those drafts too
    draft_slots: Int[np.ndarray, "T"] | None = None

    def select(self, rows: Int[np.ndarray, "K"], token_mask: Bool[np.ndarray, "T"]) -> "DraftInputs":
        """The rows `rows` (and tokens `token_mask`) of one replica, indices made local to it."""
        local_token = np.cumsum(token_mask) - 1
        return DraftInputs(local_token[self.logits_indices[rows]].astype(np.int32),
                           None if self.draft_ids is None else self.draft_ids[rows],
                           None if self.draft_slots is None else self.draft_slots[token_mask])


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step: its kind and its nested inputs (build it with the constructor of its kind)."""

    kind: PlanKind
    tokens: TokenInputs
    sampling: SamplingPlan
    loop: LoopInputs | None = None
    drafts: DraftInputs | None = None

    @classmethod
    def ragged(cls, tokens: TokenInputs, sampling: SamplingPlan) -> "StepPlan":
        """Chunked prefills and one-token decodes together; a row per sequence, after its last token."""
        return cls("ragged", tokens, sampling)._checked(rows=len(tokens.q_lens))

    @classmethod
    def decode_loop(cls, tokens: TokenInputs, sampling: SamplingPlan, loop: LoopInputs) -> "StepPlan":
        """Every sequence decodes `loop.num_steps` tokens in one device loop (a row per sequence)."""
        if tokens.target_ids is not None or np.any(tokens.q_lens != 1):
            raise ValueError("a decode loop feeds one token per sequence and returns no prompt logprobs")
        return cls("decode_loop", tokens, sampling, loop=loop)._checked(rows=len(tokens.q_lens))

    @classmethod
    def verify(cls, tokens: TokenInputs, sampling: SamplingPlan, drafts: DraftInputs) -> "StepPlan":
        """Each sequence's last token and drafts, a row sampled after each."""
        return cls("verify", tokens, sampling, drafts=drafts)._checked(rows=len(drafts.logits_indices))

    @classmethod
    def verify_loop(cls, tokens: TokenInputs, sampling: SamplingPlan, drafts: DraftInputs, loop: LoopInputs
                    ) -> "StepPlan":
        """Several draft-verify steps in one device loop: drafts made on the device, exact replay, as many
        drafts for every sequence (`loop` rows hold their sequence's values)."""
        if drafts.draft_slots is None or drafts.draft_ids is not None or len(set(tokens.q_lens.tolist())) > 1:
            raise ValueError("a verification loop takes device drafts, exact replay and as many drafts per sequence")
        return cls("verify_loop", tokens, sampling, loop=loop, drafts=drafts)._checked(rows=len(drafts.logits_indices))

    def _checked(self, rows: int) -> "StepPlan":
        if len(self.sampling.rows) != rows or len(self.sampling.suppress_ids) != rows:
            raise ValueError(f"a {self.kind} plan samples {rows} rows; its sampling inputs have "
                             f"{len(self.sampling.rows)}")
        if self.loop is not None and len(self.loop.num_steps) != rows:
            raise ValueError(f"a {self.kind} plan's loop inputs need {rows} rows, got {len(self.loop.num_steps)}")
        return self

    @property
    def num_rows(self) -> int:
        """Sampled rows: one per sequence, or one per fed token of a verification."""
        return len(self.sampling.rows)

    @property
    def num_seqs(self) -> int:
        return len(self.tokens.q_lens)

    def ahead(self, kept: Int[np.ndarray, "K"], num_steps: Int[np.ndarray, "K"], block_tables: list[list[int]],
              feed_rows: Int[np.ndarray, "K"], *, num_top_logprobs: int, sampling_record: bool) -> "StepPlan":
        """The decode loop after this one, launched before this one's tokens reach the host (async
        scheduling): sequence i is row `kept[i]` here, every sequence having taken all its steps here;
        its input token is its last one of this call (`feed_rows`: its row in this call's outputs), fed
        on the device. Rows are taken, not rebuilt: a row's `suppress_ids` are its ending ids whenever
        `suppress_steps` still counts down (the device applies them only then)."""
        if self.kind != "decode_loop":
            raise ValueError(f"only a decode loop launches the next one ahead, not a {self.kind} plan")
        t, loop, done = self.tokens, self.loop, self.loop.num_steps[kept]
        tokens = TokenInputs(np.zeros(len(kept), np.int32), t.positions[kept] + done, t.q_lens[kept],
                             t.kv_lens[kept] + done, block_tables, None if t.replicas is None else t.replicas[kept])
        sampling = dataclasses.replace(self.sampling.take(kept), num_top_logprobs=num_top_logprobs,
                                       sampling_record=sampling_record)
        return StepPlan.decode_loop(tokens, sampling, LoopInputs(
            np.asarray(num_steps, np.int32), np.maximum(loop.suppress_steps[kept] - done, 0), loop.stop_ids[kept],
            np.asarray(feed_rows, np.int32)))
