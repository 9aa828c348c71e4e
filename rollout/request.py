"""`Request`: one entry of the engine core's request table (a prompt, its params, its n sequences),
and how its `RequestOutput`s are assembled: cumulative, as deltas since the last one, or final only.
Plain Python."""

from __future__ import annotations

import dataclasses
import functools

from rollout.outputs import CompletionLogprobs, CompletionOutput, RequestOutput, TokenLogprob
from rollout.sampling_params import OutputKind, SamplingParams
from rollout.sequence import Sequence
from rollout.tokenizer import Tokenizer


@dataclasses.dataclass
class Request:
    """What the engine core keeps per request id until its final output has been returned."""

    request_id: str
    prompt: str | None  # the text, when the request came as text
    params: SamplingParams
    seqs: list[Sequence]
    num_outputs_sent: int = 0
    # per sample, for delta outputs: tokens and characters of text already sent, and whether its last was
    num_sent_tokens: list[int] = dataclasses.field(default_factory=list)
    num_sent_chars: list[int] = dataclasses.field(default_factory=list)
    sent_final: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_sent_tokens = [0] * len(self.seqs)
        self.num_sent_chars = [0] * len(self.seqs)
        self.sent_final = [False] * len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def completion(seq: Sequence, tokenizer: Tokenizer, *, start: int = 0, text_start: int | None = None,
               final: bool = True) -> CompletionOutput:
    """One sample's output from token `start` on; its text whole, or from character `text_start` on (a
    streamed delta: work in proportion to the new text, `delta_text`)."""
    p = seq.params
    out_ids = seq.output_ids
    if text_start is None:
        text = sample_text(seq, tokenizer, final=final)
    else:
        text = delta_text(seq, tokenizer, text_start)
    logprobs = cumulative = None
    if p.logprobs is not None:
        logprobs = CompletionLogprobs(out_ids[start:], seq.out.logprobs[start:],
                                      seq.out.top[start:] if p.logprobs else None, seq.out.ranks[start:],
                                      functools.partial(token_text, tokenizer) if p.detokenize else None)
        cumulative = float(sum(seq.out.logprobs))
    versions = seq.out.versions[start:]
    record = p.sampling_record
    return CompletionOutput(index=seq.sample_index, token_ids=out_ids[start:], text=text,
                            logprobs=logprobs, cumulative_logprob=cumulative, finish_reason=seq.out.finish_reason,
                            stop_reason=seq.out.stop_reason,
                            policy_version=seq.out.versions[-1] if seq.out.versions else seq.admitted_version,
                            policy_versions=versions,
                            kept_logmass=seq.out.kept_logmass[start:] if record else None,
                            kept_ids=seq.out.kept_ids[start:] if record else None,
                            routed_experts=seq.out.routed_experts if seq.is_finished else None)


def sample_text(seq: Sequence, tokenizer: Tokenizer, *, final: bool = True) -> str:
    """A sample's whole text. As in vLLM, it leaves out what stopped it (a stop string, cut where it
    starts; the stop id or EOS that ended it) unless `include_stop_str_in_output`; `token_ids` keep every
    token. While the sample runs (`final` False) and it has stop strings, the last `len(longest stop) - 1`
    characters are held back (they may yet begin a stop string)."""
    p, out_ids = seq.params, seq.output_ids
    if not p.detokenize:
        return ""
    by_token = seq.out.finish_reason == "stop" and not isinstance(seq.out.stop_reason, str)  # a stop id or EOS
    drop_last = by_token and not p.include_stop_str_in_output
    if seq.out.detokenizer is not None:  # its text is decoded already
        text = seq.out.detokenizer.final_text(out_ids, drop_last=drop_last)
    else:
        text = tokenizer.decode(out_ids[:len(out_ids) - drop_last], skip_special_tokens=p.skip_special_tokens)
    if isinstance(seq.out.stop_reason, str) and seq.out.stop_text_at is not None:
        return text[:seq.out.stop_text_at + (len(seq.out.stop_reason) if p.include_stop_str_in_output else 0)]
    if p.stop and not final and not seq.is_finished:
        return text[:max(0, len(text) - max(map(len, p.stop)) + 1)]
    return text


def delta_text(seq: Sequence, tokenizer: Tokenizer, sent: int) -> str:
    """A sample's text after its first `sent` characters, from its incremental detokenizer: only what its
    new tokens added (a character still incomplete waits; with stop strings, the last `len(longest stop)
    - 1` characters wait too), and the rest of `sample_text` once it has ended."""
    if not seq.params.detokenize:
        return ""
    detok = seq.text_decoder(tokenizer)
    if seq.is_finished:
        return sample_text(seq, tokenizer)[sent:]
    detok.advance(seq.output_ids)
    stop = seq.params.stop
    visible = detok.length - (max(map(len, stop)) - 1 if stop else 0)
    return detok.tail(detok.length - sent)[:max(0, visible - sent)]


def request_output(req: Request, tokenizer: Tokenizer, kind: OutputKind | None = None) -> RequestOutput | None:
    """The output a step reports for `req` under its `output_kind`, or `kind` (None: nothing to report now)."""
    kind = kind or req.params.output_kind
    finished = req.finished
    if kind == "final_only" and not finished:
        return None
    first = req.seqs[0]
    prompt_logprobs = None
    if first.params.prompt_logprobs is not None and (kind != "delta" or not req.num_outputs_sent):
        prompt_logprobs = [None] + [
            TokenLogprob(t, lp, dict(zip(ids, lps)))
            for t, lp, (ids, lps) in zip(first.token_ids[1:first.num_prompt_tokens], first.out.prompt_logprobs,
                                         first.out.prompt_top)]
    if kind != "delta":
        outputs = [completion(s, tokenizer, final=finished) for s in req.seqs]
    else:
        outputs = []
        for i, seq in enumerate(req.seqs):
            if req.sent_final[i] or (seq.num_output_tokens == req.num_sent_tokens[i] and not seq.is_finished):
                continue
            out = completion(seq, tokenizer, start=req.num_sent_tokens[i], text_start=req.num_sent_chars[i],
                             final=False)
            req.num_sent_tokens[i] = seq.num_output_tokens
            req.num_sent_chars[i] += len(out.text)
            req.sent_final[i] = seq.is_finished
            outputs.append(out)
        if not outputs:
            return None
    req.num_outputs_sent += 1
    return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                         prompt_token_ids=first.token_ids[:first.num_prompt_tokens],
                         prompt_logprobs=prompt_logprobs, outputs=outputs, finished=finished)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token decoded alone, special tokens included (vLLM's `Logprob.decoded_token`)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
