"""OpenAI-shaped response bodies (vLLM's layout) built from the engine's `RequestOutput`s: choices,
logprobs in the completions and the chat layouts, prompt logprobs, usage."""

from __future__ import annotations

import time
import uuid

from rollout.outputs import CompletionOutput, RequestOutput, TokenLogprob
from rollout.tokenizer import Tokenizer


class Formatter:
    """Token text and logprob objects for one request (`return_tokens_as_token_ids` shows ids as text)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def token(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _top(self, lp: TokenLogprob) -> dict[int, float]:
        """The alternatives plus the sampled token (vLLM always lists it)."""
        return {**lp.top, lp.token_id: lp.logprob} if lp.token_id not in lp.top else dict(lp.top)

    def completion_logprobs(self, logprobs: list[TokenLogprob] | None, text_offset: int) -> dict | None:
        if logprobs is None:
            return None
        tokens = [self.token(t.token_id) for t in logprobs]
        offsets, at = [], text_offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        return {"text_offset": offsets, "token_logprobs": [t.logprob for t in logprobs], "tokens": tokens,
                "top_logprobs": [{self.token(i): v for i, v in self._top(t).items()} for t in logprobs]}

    def chat_logprobs(self, logprobs: list[TokenLogprob] | None, num_top: int) -> dict | None:
        if logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, v) for i, v in list(t.top.items())[:num_top]]}
                            for t in logprobs]}

    def prompt_logprobs(self, logprobs: list[TokenLogprob | None] | None) -> list[dict | None] | None:
        """vLLM's layout: per prompt position None (the first) or {id: {logprob, rank, decoded_token}}."""
        if logprobs is None:
            return None
        out: list[dict | None] = []
        for t in logprobs:
            if t is None:
                out.append(None)
                continue
            ranked = list(t.top)
            entries = {i: {"logprob": v, "rank": ranked.index(i) + 1, "decoded_token": self.token(i)}
                       for i, v in t.top.items()}
            if t.token_id not in entries:
                entries[t.token_id] = {"logprob": t.logprob, "rank": None, "decoded_token": self.token(t.token_id)}
            out.append({str(i): e for i, e in entries.items()})
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput], num_completion_tokens: int | None = None) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = num_completion_tokens if num_completion_tokens is not None else sum(
        len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_choice(index: int, out: RequestOutput, c: CompletionOutput, fmt: Formatter, *, text_offset: int = 0,
                      return_token_ids: bool = False, first: bool = True) -> dict:
    choice = {"index": index, "text": c.text, "logprobs": fmt.completion_logprobs(c.logprobs, text_offset),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if first and out.prompt_logprobs is not None:
        choice["prompt_logprobs"] = fmt.prompt_logprobs(out.prompt_logprobs)
    if return_token_ids:
        choice["token_ids"] = c.token_ids
        choice["policy_versions"] = c.policy_versions
        if first:
            choice["prompt_token_ids"] = out.prompt_token_ids
    return choice


def chat_choice(index: int, out: RequestOutput, c: CompletionOutput, fmt: Formatter, num_top: int, *,
                return_token_ids: bool = False, delta: bool = False, first: bool = True) -> dict:
    message = {"role": "assistant", "content": c.text} if not delta or first else {"content": c.text}
    choice = {"index": index, "delta" if delta else "message": message,
              "logprobs": fmt.chat_logprobs(c.logprobs, num_top), "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason}
    if return_token_ids:
        choice["token_ids"] = c.token_ids
        choice["policy_versions"] = c.policy_versions
        if first:
            choice["prompt_token_ids"] = out.prompt_token_ids
    return choice


def envelope(request_id: str, kind: str, model: str, choices: list[dict], usage_: dict | None) -> dict:
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
