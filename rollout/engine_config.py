"""`EngineConfig` (the engine's budgets, validated) and `EngineStats` (its counters)."""

from __future__ import annotations

import dataclasses

from rollout.scheduler import ScheduledBatch
from rollout.speculator import SpecStats
from runner.backends import BACKENDS
from runner.backends.attention_kernels import ATTENTION_IMPLS
from runner.build import RunnerOptions
from runner.spec_decode.eagle3_config import Eagle3Config
from runner.spec_decode.ngram import NgramConfig


# Decode steps per device call by default: 1.09-1.14x tokens/s at B = 1 and 8 on a 2-core CPU,
# ~1.0-1.1x at B = 64 (examples/bench_multi_step.py); more steps per call save less and delay
# new requests longer.
DEFAULT_SCHEDULER_STEPS = 8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Budgets and cache sizes (vLLM names). KV size: `kv_cache_blocks`, or a byte budget, or
    by default enough blocks for `max_num_seqs` sequences of `max_model_len` tokens.

    On a mesh with a `data` axis of size D, every budget and cache size here is per data replica
    (like one vLLM engine per data-parallel rank): D * max_num_seqs sequences run at once.
    """

    max_num_seqs: int = 64
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    max_logprobs: int = 20
    max_kept_ids: int = 16  # most kept ids a sampling record returns per token (`SamplingParams.max_kept_ids`)
    # mixture-of-experts models: record every token's routed experts (`CompletionOutput.routed_experts`,
    # `RolloutBatch.routed_experts`), prefix-cached prompt tokens included; not with EAGLE-3
    record_routed_experts: bool = False
    enable_prefix_caching: bool = True
    # Colocated with a trainer (`Engine.from_model`): parameters already laid out as the engine's (same
    # shape, dtype, sharding) are the trainer's arrays, no second copy; `sync_weights` of such a tree swaps
    # references. Leaves needing a transform, and the backend's packed copies, are the engine's own.
    share_weights: bool = False
    # The KV cache as a fraction of the device memory free once the weights are placed (vLLM's
    # gpu_memory_utilization, for the cache alone); the rest is left to the step programs' working memory
    # and the trainer (`stats()` reports weight, KV and program bytes per device). Overrides the default
    # size; `kv_cache_blocks` / `kv_cache_memory_bytes` override it.
    kv_cache_memory_fraction: float | None = None
    speculative: NgramConfig | Eagle3Config | None = None  # draft (n-gram lookup or an EAGLE-3 head), verified
    # The kernel backend (`runner/backends/`): "auto" (the devices' platform: "cpu", "gpu" or "tpu"),
    # or "reference" (pure JAX everywhere, the oracle). Chosen once, when the engine is built.
    backend: str = "auto"
    # "auto" (`runner.backends.auto_attention_impl`): without tensor parallelism, JAX's Pallas
    # paged-attention kernel for decode steps on a GPU (on a TPU with a bfloat16 cache), the C++ kernel
    # on one CPU device with a float32 cache; the pure-JAX path otherwise. Or one of ATTENTION_IMPLS, or
    # "tpu": the KV cache in the layout of JAX's TPU `ragged_paged_attention`, every step through that
    # kernel on a TPU and through the pure-JAX reference of that layout elsewhere (docs/tpu.md).
    attention_backend: str = "auto"
    # CPU backend (`runner/backends/cpu/`): the few-row matmul kernel, AMX tiles where the CPU has them (off: a
    # bfloat16 model's matmuls go to the AVX512_BF16 kernel where the CPU has that), from how many rows AMX
    # takes layer matmuls the row kernel could, and the AVX512_BF16 kernel for a bfloat16 model without AMX.
    # These fields are the one way to set them (nothing is read from the environment).
    cpu_row_kernel: bool = True
    cpu_amx: bool = True
    cpu_amx_from_rows: int = 41
    cpu_bf16_matmul: bool = True
    # Batch-invariant mode (RL fidelity): a request's raw logprobs (and so its greedy or seeded tokens) are
    # bitwise the same whatever shares its batch, however its prompt is chunked, whether its prefix came
    # from the cache, after preemption, with or without speculation: every matmul on one kernel at every row
    # count, the C++ attention for every step, fixed-order norms (`runner.backends.cpu.backend`). The CPU
    # backend on one device or a data-parallel mesh (the same bits), dense models without sliding windows
    # or attention soft-caps.
    batch_invariant: bool = False
    # Multi-step decode (vLLM's name): up to this many decode steps per device call, the sampled
    # tokens fed back on the device; the host sees the batch (stops, new requests) once per call.
    # None: DEFAULT_SCHEDULER_STEPS. With drafting, decode steps that do not draft (auto-disable, no
    # n-gram match) run as multi-step calls; an EAGLE-3 head's cache is filled after each of their steps.
    num_scheduler_steps: int | None = None
    # JAX's persistent compilation cache (process-wide): "auto" = `runner.compilation_cache.default_cache_dir()`
    # (~/.cache/jax-rollout/xla), a folder, or None (off). A folder the process configured itself wins.
    compilation_cache_dir: str | None = "auto"
    # Async scheduling (vLLM's name): a multi-step decode call launches the next one before its tokens reach
    # the host (the device feeds them), so the device computes while the host applies the previous
    # call's tokens. Tokens are those of the synchronous order; work a stopped sequence's next call did is dropped.
    async_scheduling: bool = True
    # After start-up, every object then alive goes to the garbage collector's permanent generation
    # (`gc.freeze`, as vLLM does after its start-up), so the full collections a rollout's allocations
    # trigger skip the model, the programs and the trainer's objects. Frozen objects are still freed by
    # reference counting; reference cycles among them are collected when the next engine starts.
    freeze_gc: bool = True
    # Staleness bound for asynchronous RL: at a weight sync, a running sample whose generation began more
    # than this many policy versions ago is aborted (its partial output returned, finish_reason "abort";
    # `policy_lag_action="abort"`) or recomputed under the new weights (its tokens kept; "recompute"),
    # after which its lag counts from the new version. None: no bound.
    max_policy_lag: int | None = None
    policy_lag_action: str = "abort"
    # Lag-aware admission (AReaL's staleness control), with `max_policy_lag`: the trainer consumes this many
    # samples per policy version; a new sample starts only while at most (versions since the engine began
    # + max_policy_lag + 1) x this many have started, so no sample needs to outlive the bound. The rest
    # wait in the queue until a sync. None: admission ignores the lag.
    samples_per_version: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < 32:
            raise ValueError(f"max_num_batched_tokens must be >= 32, got {self.max_num_batched_tokens}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and (not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0):
            raise ValueError(f"kv_cache_memory_fraction must be a number in (0, 1) or None, got {fraction!r}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, got {self.kv_cache_blocks}")
        if self.speculative is not None and not isinstance(self.speculative, (NgramConfig, Eagle3Config)):
            raise ValueError("speculative must be an NgramConfig, an Eagle3Config or None, got "
                             f"{type(self.speculative).__name__}")
        if self.speculative is not None and self.speculative.k + 1 > 8:
            raise ValueError(f"speculative k must be <= 7 (a verification row holds 8 tokens), got {self.speculative.k}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("cpu_row_kernel", "cpu_amx", "cpu_bf16_matmul", "async_scheduling", "enable_prefix_caching",
                     "batch_invariant", "freeze_gc", "share_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.cpu_amx_from_rows, int) or self.cpu_amx_from_rows < 1:
            raise ValueError(f"cpu_amx_from_rows must be an integer >= 1, got {self.cpu_amx_from_rows!r}")
        if self.attention_backend not in ("auto", "tpu", *ATTENTION_IMPLS):
            raise ValueError(f"attention_backend must be 'auto', 'tpu' or one of {ATTENTION_IMPLS}, "
                             f"got {self.attention_backend!r}")
        if self.num_scheduler_steps is None:  # resolved here, so the engine reads one number
            object.__setattr__(self, "num_scheduler_steps", DEFAULT_SCHEDULER_STEPS)
        if not isinstance(self.num_scheduler_steps, int) or not 1 <= self.num_scheduler_steps <= 64:
            raise ValueError(f"num_scheduler_steps must be an integer in [1, 64], got {self.num_scheduler_steps!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (no limit: `logprobs=-1` returns the "
                             f"whole vocabulary), got {self.max_logprobs!r}")
        if not isinstance(self.record_routed_experts, bool):
            raise ValueError(f"record_routed_experts must be True or False, got {self.record_routed_experts!r}")
        if self.record_routed_experts and isinstance(self.speculative, Eagle3Config):
            raise ValueError("record_routed_experts does not work with EAGLE-3 drafting; use n-gram drafting or none")
        if not isinstance(self.max_kept_ids, int) or self.max_kept_ids < 1:
            raise ValueError(f"max_kept_ids must be an integer >= 1, got {self.max_kept_ids!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.max_policy_lag is not None and (not isinstance(self.max_policy_lag, int) or self.max_policy_lag < 0):
            raise ValueError(f"max_policy_lag must be None or an integer >= 0, got {self.max_policy_lag!r}")
        if self.samples_per_version is not None and (not isinstance(self.samples_per_version, int)
                                                     or self.samples_per_version < 1):
            raise ValueError(f"samples_per_version must be None or an integer >= 1, got {self.samples_per_version!r}")
        if self.samples_per_version is not None and self.max_policy_lag is None:
            raise ValueError("samples_per_version bounds admission by max_policy_lag: set max_policy_lag too")
        if self.policy_lag_action not in ("abort", "recompute"):
            raise ValueError(f"policy_lag_action must be 'abort' or 'recompute', got {self.policy_lag_action!r}")
        if self.compilation_cache_dir is not None and (not isinstance(self.compilation_cache_dir, str)
                                                       or not self.compilation_cache_dir):
            raise ValueError(f"compilation_cache_dir must be 'auto', a folder or None, got {self.compilation_cache_dir!r}")

    def runner_options(self, executable_dir: str | None) -> RunnerOptions:
        """The runner's share of this config (`runner.build.build_runner`); `executable_dir`: where its
        compiled step programs are stored (None: not stored)."""
        spec = self.speculative
        return RunnerOptions(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=self.block_size, kv_cache_blocks=self.kv_cache_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            share_weights=self.share_weights, backend=self.backend,
            attention_backend=self.attention_backend, cpu_row_kernel=self.cpu_row_kernel, cpu_amx=self.cpu_amx,
            cpu_amx_from_rows=self.cpu_amx_from_rows, cpu_bf16_matmul=self.cpu_bf16_matmul,
            batch_invariant=self.batch_invariant,
            max_logprobs=self.max_logprobs if self.max_logprobs >= 0 else 20, max_kept_ids=self.max_kept_ids,
            num_scheduler_steps=self.num_scheduler_steps, speculative_k=spec.k if spec is not None else 0,
            eagle3=spec if isinstance(spec, Eagle3Config) else None, executable_dir=executable_dir,
            record_routing=self.record_routed_experts)


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine was built."""

    num_steps: int = 0
    num_prefill_steps: int = 0  # ragged steps: chunks of prompts, with a token of every running decode
    num_decode_steps: int = 0  # decode loops and verifications: each runs up to `num_scheduler_steps` steps
    prefill_tokens: int = 0  # tokens computed in ragged steps (their decodes' tokens included)
    decode_tokens: int = 0  # decode steps scheduled in decode loops and verifications, summed over sequences
    generated_tokens: int = 0
    num_sequences: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    num_compilations: int = 0
    num_weight_syncs: int = 0
    num_ahead_calls: int = 0  # decode calls launched before the previous call's tokens reached the host
    num_lag_aborts: int = 0  # samples aborted by `max_policy_lag`
    num_lag_recomputes: int = 0  # samples recomputed under new weights by `max_policy_lag`
    num_lag_held: int = 0  # samples whose start lag-aware admission (`samples_per_version`) postponed
    generate_seconds: float = 0.0
    speculative: SpecStats | None = None  # drafting counters when speculation is configured
    backend: str = ""  # the kernel backend chosen (runner/backends/)
    cpu_row_kernel: str = ""  # "ok": steps of <= 64 rows use runner.backends.cpu.row_matmul (tied head <= 8); else why XLA's dot
    # "ok": matmuls `runner.backends.cpu.amx_matmul.takes` use AMX tiles (the layers' of >= 41 rows where the row kernel
    # runs, else >= 9; the tied head's past 8 rows); else why not
    cpu_amx: str = ""
    cpu_bf16_matmul: str = ""  # a bfloat16 model's matmuls: "ok: AMX tiles" / "ok: AVX512_BF16 ..." or why XLA's dot
    attention_impl: str = ""  # the attention kernel of every step (runner.backends.attention_kernels.ATTENTION_IMPLS)
    # which steps the attention kernel serves and which the pure-JAX path takes, and why; for the TPU ragged
    # kernel its shapes (the model's heads, or what is zero-padded and the cache's cost) and its block sizes
    # per chip generation (`runner.tpu_attention`)
    attention_kernel: str = ""
    batch_invariant: str = ""  # "on: ..." (which kernels sum each row alike) or "off" (`EngineConfig.batch_invariant`)
    # memory per device (`runner.model_runner.RunnerMemory`): the trainer's weights the engine reads
    # (`share_weights`), the engine's own (copies, packed copies), the KV cache, the largest step program's
    # working memory and code
    weight_bytes_shared: int = 0
    weight_bytes_held: int = 0
    kv_cache_bytes: int = 0
    program_bytes: int = 0

    @property
    def generated_tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    def record_step(self, kind: str, batch: ScheduledBatch) -> None:
        """Count one device call of a plan `kind` (`runner.step_plan.PLAN_KINDS`)."""
        self.num_steps += 1
        if kind == "ragged":
            self.num_prefill_steps += 1
            self.prefill_tokens += batch.num_tokens
        else:
            self.num_decode_steps += 1
            self.decode_tokens += batch.num_tokens
