"""`SamplingParams`: how one prompt is sampled (vLLM names), validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

LogprobsMode = Literal["raw", "processed", "raw_logits", "processed_logits"]
_MODE_ALIASES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}  # vLLM's names of the same modes
OutputKind = Literal["cumulative", "delta", "final_only"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-prompt sampling settings.

    `logprobs=None` returns no logprobs; `logprobs=k` returns the sampled token's logprob plus the
    k most likely alternatives (k may be 0; -1: the whole vocabulary, where the engine's `max_logprobs`
    is -1). `logprobs_mode="raw"` is the log-softmax of the model's logits (what a trainer's plain
    forward computes); `"processed"` is the log-probability under the distribution actually sampled
    from (after the logits processors below, temperature, top-k, top-p, min-p; greedy requests use
    temperature 1 there); `"raw_logits"` / `"processed_logits"` report those logits instead of
    log-probabilities (vLLM's `raw_logprobs` / `processed_logprobs` are accepted for the first two).

    Logits processors (vLLM's, in its order, before temperature; none of them changes raw logprobs):
    `allowed_token_ids` (only these may be sampled), `bad_words` (a word's last token is banned where
    the output so far ends with the rest of it; each word is tokenized with and without a leading
    space), `logit_bias` (token id -> added logit, in [-100, 100]), then `repetition_penalty` (> 1
    divides positive and multiplies negative logits of tokens in the prompt or output),
    `frequency_penalty` (subtracted once per occurrence in the output) and `presence_penalty`
    (subtracted once if in the output). `seed=None` draws a seed from the engine's generator. `output_kind` (vLLM's
    `RequestOutputKind`) is what `Engine.step` reports for the request: everything so far
    ("cumulative"), what is new since its last output ("delta", for streaming), or only the final
    output ("final_only", what `generate` uses).

    `sampling_record=True` reports, per generated token, the log of the probability mass the filters
    (and suppression) kept of softmax(logits / T) (`CompletionOutput.kept_logmass`), so a trainer can
    recover the processed logprob from its own forward (`log_softmax(logits / T)[t] - kept_logmass`), and,
    where the kept set has at most `max_kept_ids` tokens, its ids (`kept_ids`, most likely first), so it
    can renormalise its new policy over the same set.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: LogprobsMode = "raw"
    skip_special_tokens: bool = True
    output_kind: OutputKind = "cumulative"
    include_stop_str_in_output: bool = False  # keep the stop string (or stop id's / EOS's text) in `text`
    detokenize: bool = True  # False: `text` stays "" (token ids only; no stop strings then)
    sampling_record: bool = False  # kept mass (and kept ids) of every generated token
    max_kept_ids: int = 0  # with `sampling_record`: the kept set's ids where it has at most this many
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    bad_words: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"SamplingParams: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            fail(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail(f"top_k must be an integer >= -1 (0 or -1 = no top-k), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not (0.0 <= self.min_p <= 1.0):
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            fail(f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1 or None (until max_model_len), got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
                fail(f"{name} must be None, an integer >= 0, or -1 (the whole vocabulary), got {value!r}")
        mode = _MODE_ALIASES.get(self.logprobs_mode, self.logprobs_mode)
        if mode not in ("raw", "processed", "raw_logits", "processed_logits"):
            fail(f"logprobs_mode must be 'raw', 'processed', 'raw_logits' or 'processed_logits', "
                 f"got {self.logprobs_mode!r}")
        object.__setattr__(self, "logprobs_mode", mode)
        self._check_processors(fail)
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            fail(f"output_kind must be 'cumulative', 'delta' or 'final_only', got {self.output_kind!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            fail(f"stop must be a string or a list of strings, got {stop!r}")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            fail(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.detokenize, bool):
            fail(f"detokenize must be True or False, got {self.detokenize!r}")
        if stop and not self.detokenize:
            fail("stop strings need detokenize=True (the text is what they are searched in); use stop_token_ids")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"SamplingParams: stop_token_ids must be a list of token ids, got "
                            f"{type(self.stop_token_ids).__name__} {self.stop_token_ids!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            fail(f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}")
        if not isinstance(self.sampling_record, bool):
            fail(f"sampling_record must be True or False, got {self.sampling_record!r}")
        if not isinstance(self.max_kept_ids, int) or self.max_kept_ids < 0:
            fail(f"max_kept_ids must be an integer >= 0, got {self.max_kept_ids!r}")
        if self.max_kept_ids and not self.sampling_record:
            fail("max_kept_ids needs sampling_record=True")
        if self.sampling_record and (self.has_penalties or self.logit_bias is not None):
            fail("sampling_record describes the model's own logits with tokens masked out: it cannot carry "
                 "logit_bias or penalties (allowed_token_ids and bad_words are fine); drop one of them")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in ids):
            fail(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)

    def _check_processors(self, fail: Callable[[str], None]) -> None:
        """Validate (and normalise to tuples / a dict of ints to floats) the logits processors' fields."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                fail(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (math.isfinite(rp) and rp > 0):
            fail(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            bias = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key  # JSON keys are strings
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    fail(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100.0 <= value <= 100.0:
                    fail(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key!r}")
                bias[token] = float(value)
            object.__setattr__(self, "logit_bias", bias or None)
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed:
                fail(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in allowed):
                fail(f"allowed_token_ids must be integers >= 0, got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(allowed)))
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not isinstance(words, (list, tuple)):
                fail(f"bad_words must be a list of strings, got {words!r}")
            if any(not isinstance(w, str) or not w.strip() for w in words):
                fail(f"bad_words must be non-empty strings, got {words!r}")
            object.__setattr__(self, "bad_words", tuple(words) or None)

    @property
    def has_processors(self) -> bool:
        """Uses a logits processor (penalties, bias, allowed ids or bad words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.logit_bias is not None or self.allowed_token_ids is not None or self.bad_words is not None)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

