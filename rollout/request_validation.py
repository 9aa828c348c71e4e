"""Checks on what `Engine.generate` is given, before anything is queued: prompts and sampling params
normalised to one list each, and each prompt's token ids, or a `ValueError` saying what was wrong and
what to do (so a bad request leaves the engine's state untouched)."""

from __future__ import annotations

import dataclasses
from typing import Sequence as Seq

import numpy as np

from rollout.sampling_params import SamplingParams
from rollout.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What the engine can take: its vocabulary, context length, top-logprob count (-1: any), and why it
    cannot take some features ("" = it can)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    eos_token_ids: tuple[int, ...]
    max_kept_ids: int = 16  # kept ids a sampling record can return per token
    processors: str = ""  # why this engine cannot apply logits processors ("" = it can)


def normalize_requests(prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                       ) -> tuple[list[Prompt], list[SamplingParams]]:
    """One prompt or several, and one `SamplingParams` (or None: the defaults) or one per prompt."""
    if prompts is None or not isinstance(prompts, (str, list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got "
                         f"{type(prompts).__name__}")
    if isinstance(sampling_params, dict):
        raise ValueError("sampling_params must be SamplingParams (or a list of them, one per prompt), got a dict: "
                         "pass SamplingParams(**your_dict)")
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, float, np.number))):
        prompts = [prompts]
    prompts_list = list(prompts)
    if not prompts_list:
        raise ValueError("generate() needs at least one prompt")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params_list = [sampling_params] * len(prompts_list)
    else:
        params_list = list(sampling_params)
        if len(params_list) != len(prompts_list):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts_list)} prompts; "
                             "pass one, or one per prompt")
    return prompts_list, params_list


def prompt_token_ids(prompt: Prompt, sp: SamplingParams, tokenizer: Tokenizer, limits: RequestLimits) -> list[int]:
    """Token ids of a prompt, or a ValueError saying what is wrong (nothing is queued yet)."""
    if not isinstance(sp, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give at least one character or token")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        if set(map(type, prompt)) <= {int}:  # plain ints (the usual case), checked without a Python loop
            ids = list(prompt)
        else:
            bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            if bad:
                raise ValueError(f"prompt token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__}); "
                                 "pass text as a string, token ids as ints")
            ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    vocab = limits.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        bad = [t for t in ids if not 0 <= t < vocab]
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) >= limits.max_model_len:
        raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                         f"{limits.max_model_len}; shorten it or raise max_model_len")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k == -1 and limits.max_logprobs != -1:
            raise ValueError(f"{name}=-1 (the whole vocabulary) needs an engine built with max_logprobs=-1 "
                             f"(this one returns at most {limits.max_logprobs})")
        if k is not None and limits.max_logprobs != -1 and k > limits.max_logprobs:
            raise ValueError(f"{name}={k} exceeds the engine's max_logprobs={limits.max_logprobs}; "
                             "ask for fewer or build the engine with a larger max_logprobs")
    if sp.max_kept_ids > limits.max_kept_ids:
        raise ValueError(f"max_kept_ids={sp.max_kept_ids} exceeds the engine's max_kept_ids={limits.max_kept_ids}; "
                         "ask for fewer or build the engine with a larger max_kept_ids")
    if sp.has_processors and limits.processors:
        raise ValueError(f"penalties, logit_bias, allowed_token_ids and bad_words are not available on this "
                         f"engine: {limits.processors}")
    for name, token_ids in (("logit_bias", sp.logit_bias or {}), ("allowed_token_ids", sp.allowed_token_ids or ())):
        bad = [t for t in token_ids if t >= vocab]
        if bad:
            raise ValueError(f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    bad = [t for t in sp.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return ids


def bad_words_token_ids(words: Seq[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as vLLM finds them: the word as given, and with a leading space where
    that tokenizes to a different first token but as many tokens."""
    found: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        if plain:
            found.append(plain)
        if not word.startswith(" "):
            spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                found.append(spaced)
    return tuple(dict.fromkeys(found))
