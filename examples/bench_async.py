"""Asynchronous rollouts, measured: streaming vs blocking, the HTTP server vs the engine, in-flight syncs.

    python examples/bench_async.py                 # all three parts on the embedded SmolLM2-135M
    python examples/bench_async.py --tiny --parts a,c --rounds 1   # a smoke run on a random 2-layer model

(a) A GRPO step whose groups finish unevenly: 8 of R1's prompts x n = 8 samples, group g capped at
    16 (g + 1) new tokens (EOS ignored, temperature 1, logprobs on). The blocking `Engine.generate` hands
    every group over when the last one ends; `AsyncEngine.generate` hands each group over when it ends.
    Prints both times to the last token (ratio: blocking / async, 1.0 = no overhead from the async loop)
    and the mean time until a group is in the trainer's hands (ratio blocking / async).
(b) The OpenAI-compatible server (`python -m rollout.serve`, its own process) at 64 concurrent clients
    (`openai.AsyncOpenAI`, /v1/completions) vs the in-process `Engine.generate` on the same requests: R1
    B = 64, 128 greedy tokens. Ratio server / in-process tokens/s (target >= 0.8); token ids must match.
(c) In-flight weight sync: B = 8 (R1) decoding 128 tokens with `sync_weights` (the full model, its own
    `nnx.State`) after every 4th engine step. The decode stall per sync (median of sync + the step after
    it, minus the median step without a sync before it) over a bare sync with nothing running (target
    <= 1.5).

Rounds alternate the two sides of each comparison; medians. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_common as bc
from rollout import AsyncEngine, Engine, SamplingParams, load_tokenizer


def make_engine(tiny: bool, max_num_seqs: int, max_model_len: int) -> Engine:
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=1024)
    if tiny:
        import rl_common as rl

        tok = load_tokenizer(None)
        return Engine.from_model(rl.tiny_model(tok.vocab_size, tok.eos_token_ids), tok, **kw)
    return Engine.from_pretrained(None, **kw)


def part_a(tiny: bool, rounds: int) -> dict[str, float]:
    engine = make_engine(tiny, 64, 256)
    prompts = [bc.r1_prompt(i) for i in range(8)]
    params = [SamplingParams(n=8, temperature=1.0, seed=i, max_tokens=16 * (i + 1), ignore_eos=True, logprobs=0)
              for i in range(8)]

    def blocking() -> tuple[float, float]:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        end = time.perf_counter() - t0
        return end, end

    async def streamed() -> tuple[float, float]:
        aengine = AsyncEngine(engine)
        t0 = time.perf_counter()

        async def one(p: str, sp: SamplingParams) -> float:
            await aengine.generate(p, sp)
            return time.perf_counter() - t0

        done = await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
        await aengine.close()
        return max(done), statistics.mean(done)

    blocking()  # compile
    asyncio.run(streamed())
    b_runs, a_runs = [], []
    for _ in range(rounds):
        b_runs.append(blocking())
        a_runs.append(asyncio.run(streamed()))
    b_last, b_mean = (statistics.median(x) for x in zip(*b_runs))
    a_last, a_mean = (statistics.median(x) for x in zip(*a_runs))
    bc.print_table(["(a) uneven GRPO groups", "last token s", "mean group ready s"],
                   [["blocking generate", f"{b_last:.2f}", f"{b_mean:.2f}"],
                    ["AsyncEngine per group", f"{a_last:.2f}", f"{a_mean:.2f}"],
                    ["ratio blocking / async", f"{b_last / a_last:.2f}", f"{b_mean / a_mean:.2f}"]])
    return dict(a_last_token_ratio=b_last / a_last, a_group_ready_ratio=b_mean / a_mean, a_blocking_s=b_last,
                a_async_s=a_last)


def part_b(rounds: int, clients: int = 64, tokens: int = 128) -> dict[str, float]:
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "rollout.serve", "--port", str(port), "--max-model-len", "256",
                               "--max-num-seqs", str(clients), "--max-num-batched-tokens", "1024"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = make_engine(False, clients, 256)
        prompts = [bc.r1_prompt(i) for i in range(clients)]
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        url = f"http://127.0.0.1:{port}"
        for _ in range(2400):  # the server compiles every step bucket first
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.25)

        async def served() -> tuple[float, list[list[int]]]:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
                t0 = time.perf_counter()
                rs = await asyncio.gather(*(client.completions.create(
                    model="SmolLM2-135M-Instruct", prompt=p, max_tokens=tokens, temperature=0.0,
                    extra_body={"ignore_eos": True, "return_token_ids": True}) for p in prompts))
                return time.perf_counter() - t0, [r.choices[0].token_ids for r in rs]

        def local() -> tuple[float, list[list[int]]]:
            t0 = time.perf_counter()
            outs = engine.generate(prompts, sp)
            return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

        local()
        asyncio.run(served())  # compile both sides
        l_times, s_times = [], []
        for _ in range(rounds):
            t, want = local()
            l_times.append(t)
            t, got = asyncio.run(served())
            s_times.append(t)
        same = got == want
    finally:
        server.terminate()
        server.wait(timeout=30)
    n = clients * tokens
    l_tps, s_tps = n / statistics.median(l_times), n / statistics.median(s_times)
    bc.print_table(["(b) R1 B=64, 128 tokens", "tok/s"],
                   [["in-process Engine.generate", f"{l_tps:.0f}"], [f"server, {clients} clients", f"{s_tps:.0f}"],
                    ["ratio server / in-process", f"{s_tps / l_tps:.2f}"], ["same token ids", str(same)]])
    return dict(b_server_tok_s=s_tps, b_engine_tok_s=l_tps, b_ratio=s_tps / l_tps, b_same_tokens=same)


def part_c(tiny: bool, rounds: int, batch: int = 8, tokens: int = 128, every: int = 4) -> dict[str, float]:
    from flax import nnx

    engine = make_engine(tiny, batch, 256)
    params = nnx.state(engine.model, nnx.Param)
    prompts = [bc.r1_prompt(i) for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    def decode(sync: bool) -> tuple[list[float], list[float]]:
        """Step times of one run; with `sync`, a sync after every `every`-th step: (plain step times,
        sync + the step after it)."""
        for p in prompts:
            engine.add_request(p, sp)
        plain, synced, steps = [], [], 0
        pending = None  # the time of the sync before this step
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            (plain if pending is None else synced).append(dt + (pending or 0.0))
            pending, steps = None, steps + 1
            if sync and steps % every == 0 and engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.sync_weights(params)
                pending = time.perf_counter() - t0
        return plain, synced

    def bare() -> float:
        t0 = time.perf_counter()
        engine.sync_weights(params)
        return time.perf_counter() - t0

    decode(True), bare()
    plain, synced, bare_s = [], [], []
    for _ in range(rounds):
        p_times, s_times = decode(True)
        plain += p_times[1:]  # the first is the prefill
        synced += s_times
        bare_s += [bare() for _ in range(5)]
    step_med = statistics.median(plain)
    stall = statistics.median(synced) - step_med
    bare_med = statistics.median(bare_s)
    num_syncs = len(synced)
    bc.print_table([f"(c) B={batch} decode, sync every {every} steps", "s"],
                   [["decode call (8 steps)", f"{step_med:.3f}"],
                    [f"sync + the call after it ({num_syncs} syncs)", f"{statistics.median(synced):.3f}"],
                    ["stall per sync", f"{stall * 1e3:.1f} ms"], ["bare sync", f"{bare_med * 1e3:.1f} ms"],
                    ["ratio stall / bare sync", f"{stall / bare_med:.2f}"]])
    return dict(c_stall_ms=stall * 1e3, c_bare_sync_ms=bare_med * 1e3, c_ratio=stall / bare_med, c_num_syncs=num_syncs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="a,b,c")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a random 2-layer model (parts a and c)")
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parts = args.parts.split(",")
    result: dict[str, object] = {"bench": "async", "model": "tiny" if args.tiny else "SmolLM2-135M", "rounds": args.rounds}
    if "a" in parts:
        result |= part_a(args.tiny, args.rounds)
    if "b" in parts:
        if args.tiny:
            raise SystemExit("part b serves the default model; drop --tiny or --parts b")
        result |= part_b(args.rounds)
    if "c" in parts:
        result |= part_c(args.tiny, args.rounds)
    result["peak_rss_mib"] = bc.peak_rss_bytes() / 2**20
    print(bc.json_line(result))


if __name__ == "__main__":
    main()
