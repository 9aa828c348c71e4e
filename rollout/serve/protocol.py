"""The OpenAI-compatible request bodies (vLLM's shape and extensions) and their `SamplingParams`.

Fields the engine does not implement are rejected when set to anything but their neutral value, so a
client never gets silently different sampling than it asked for."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False  # also return prompt and completion token ids (token in / token out)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def _check_unsupported(self) -> None:
        unknown = sorted(set(self.model_extra or ()))
        if unknown:
            raise ValueError(f"unknown request fields {unknown}; see the server's API documentation for the "
                             "supported ones")

    def _sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int) -> SamplingParams:
        self._check_unsupported()
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=default_max if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            output_kind="delta" if self.stream else "final_only")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        if not p:
            raise ValueError("prompt is empty: give a string, a list of token ids, or a list of those")
        return list(p)

    def sampling_params(self, remaining: int) -> SamplingParams:
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported by this engine; leave them out")
        return self._sampling(self.max_tokens, self.logprobs, remaining)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self, remaining: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(limit, (self.top_logprobs or 0) if self.logprobs else None, remaining)
