"""The device step: padded inputs -> one jitted call (model over the paged KV cache + sampling) -> ids.

The runner never sees a request object: `StepBatch` is a handful of numpy arrays describing one
step. It pads them to a bucket (`runner.buckets`), moves them to the device in one transfer, runs
the compiled program for that bucket (the KV caches are donated and updated in place) and brings
back only the sampled ids and logprobs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from runner.attention import AttentionMetadata
from runner.buckets import BucketConfig, pick
from runner.kv_cache import KVCacheSpec, allocate_kv_caches
from runner.models.llama import KVCaches, LlamaForCausalLM
from runner.sampler import SamplerOutput, SamplingInputs, sample
from runner.sharding import kv_cache_sharding, make_mesh, shard_params

SAMPLER_MODES = ("greedy", "random", "filtered")
MAX_SUPPRESS = 8  # ids a request may forbid per step (EOS + stop ids before min_tokens)
VERIFY_Q_LEN = 8  # attention rows of a speculative verification step hold up to this many tokens


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step as exact-size host arrays (S sequences, T tokens); built by the engine."""

    token_ids: np.ndarray  # [T] tokens whose K/V this step computes, packed by sequence
    positions: np.ndarray  # [T]
    q_lens: np.ndarray  # [S] tokens of each sequence in this step
    kv_lens: np.ndarray  # [S] context length of each sequence after this step
    block_tables: list[list[int]]  # [S][blocks] KV blocks of each sequence
    temperature: np.ndarray  # [S]
    top_k: np.ndarray  # [S]
    top_p: np.ndarray  # [S]
    min_p: np.ndarray  # [S]
    seeds: np.ndarray  # [S]
    sample_index: np.ndarray  # [S]
    processed: np.ndarray  # [S] bool: logprobs of the processed distribution
    suppress_ids: np.ndarray  # [S, MAX_SUPPRESS] ids forbidden this step, -1 = none
    num_top_logprobs: int = 0
    target_ids: np.ndarray | None = None  # [T] next token of each position: asks for per-token logprobs
    # [R] packed tokens whose logits are sampled (speculative verification samples after every token);
    # None = the last token of each sequence. The sampling arrays above then have R rows, not S.
    logits_indices: np.ndarray | None = None

    @property
    def is_decode(self) -> bool:
        return bool(np.all(self.q_lens == 1)) and self.target_ids is None and self.logits_indices is None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What comes back to the host: one sampled token per sequence (and per-token logprobs if asked)."""

    token_ids: np.ndarray  # [S]
    logprobs: np.ndarray  # [S] of the sampled token, in each sequence's mode
    top_ids: np.ndarray  # [S, K]
    top_logprobs: np.ndarray  # [S, K]
    token_logprobs: np.ndarray | None = None  # [T] raw logprob of target_ids[t] after token t
    token_top_ids: np.ndarray | None = None  # [T, K]
    token_top_logprobs: np.ndarray | None = None  # [T, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    """A padded `StepBatch` on the device."""

    token_ids: Int[Array, "T"]
    positions: Int[Array, "T"]
    md: AttentionMetadata
    logits_indices: Int[Array, "S"]  # packed index of the token each sequence samples after
    sampling: SamplingInputs
    mode: Int[Array, ""]  # index into SAMPLER_MODES
    target_ids: Int[Array, "T"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Per-token raw logprobs of given next tokens (prompt logprobs)."""

    logprobs: Float[Array, "T"]
    top_ids: Int[Array, "T K"]
    top_logprobs: Float[Array, "T K"]


def _step(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, kv_caches: KVCaches, batch: DeviceBatch,
          *, num_top: int, token_logprobs: bool) -> tuple[KVCaches, SamplerOutput, TokenLogprobs | None]:
    model: LlamaForCausalLM = nnx.merge(graphdef, params, rest)
    hidden, kv_caches = model.forward_paged(batch.token_ids, batch.positions, kv_caches, batch.md)
    logits = model.compute_logits(hidden[batch.logits_indices])
    branches = [functools.partial(sample, mode=m, num_top_logprobs=num_top) for m in SAMPLER_MODES]
    out = jax.lax.switch(batch.mode, branches, logits, batch.sampling)
    extra = None
    if token_logprobs:
        logp = jax.nn.log_softmax(model.compute_logits(hidden), axis=-1)
        target = jnp.clip(batch.target_ids, 0, logp.shape[-1] - 1)
        top_lp, top_ids = jax.lax.top_k(logp, num_top)
        extra = TokenLogprobs(jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0], top_ids, top_lp)
    return kv_caches, out, extra


# One jitted function for the process: engines over the same model structure share compiled programs.
_jitted_step = jax.jit(_step, static_argnums=(0,), static_argnames=("num_top", "token_logprobs"), donate_argnums=(3,))


class ModelRunner:
    """Owns the model's device state, the paged KV caches and the compiled step programs."""

    def __init__(self, model: LlamaForCausalLM, kv_spec: KVCacheSpec, buckets: BucketConfig,
                 *, max_logprobs: int = 20, mesh: Mesh | None = None) -> None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.mesh = mesh if mesh is not None else make_mesh(None)
        self.graphdef = graphdef
        # The runner owns its copy (a trainer may update or donate its arrays at any time), laid out
        # by the sharding rules; device_put to a new sharding copies, so copy explicitly otherwise.
        self.params = shard_params(jax.tree.map(lambda x: x.copy(), params), self.mesh)
        self.rest = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), rest),
                                   NamedSharding(self.mesh, PartitionSpec()))
        self.kv_spec = kv_spec
        shape = (kv_spec.num_blocks, kv_spec.block_size, 2 * kv_spec.num_kv_heads, kv_spec.head_dim)
        self.kv_caches = allocate_kv_caches(kv_spec, kv_cache_sharding(shape, self.mesh))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._rows = NamedSharding(self.mesh, PartitionSpec("data"))
        self.buckets = buckets
        self.max_logprobs = max_logprobs
        self.config = model.config

    def _batch_sharding(self, x: np.ndarray) -> NamedSharding:
        """Data parallelism: split a step array's leading axis over `data` when it divides evenly."""
        data = self.mesh.shape["data"]
        if data > 1 and np.ndim(x) >= 1 and np.shape(x)[0] % data == 0:
            return self._rows
        return self._replicated

    @property
    def model(self) -> LlamaForCausalLM:
        """The model bound to the runner's current parameters."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def run(self, batch: StepBatch) -> StepResult:
        """Pad, run one compiled step, and return the sampled tokens."""
        num_seqs, num_tokens = len(batch.temperature), len(batch.token_ids)  # sampled rows, tokens
        padded = self._pad(batch)
        device_batch = jax.device_put(padded, jax.tree.map(self._batch_sharding, padded))
        self.kv_caches, out, extra = _jitted_step(
            self.graphdef, self.params, self.rest, self.kv_caches, device_batch,
            num_top=self.max_logprobs if batch.num_top_logprobs > 0 else 0,
            token_logprobs=batch.target_ids is not None)
        out, extra = jax.device_get((out, extra))
        k = batch.num_top_logprobs
        result = StepResult(out.token_ids[:num_seqs], out.logprobs[:num_seqs],
                            out.top_ids[:num_seqs, :k], out.top_logprobs[:num_seqs, :k])
        if extra is not None:
            result = dataclasses.replace(
                result, token_logprobs=extra.logprobs[:num_tokens], token_top_ids=extra.top_ids[:num_tokens, :k],
                token_top_logprobs=extra.top_logprobs[:num_tokens, :k])
        return result

    def _pad(self, b: StepBatch) -> DeviceBatch:
        """Pad a step to its bucket and build the attention metadata (pure numpy)."""
        bk, page = self.buckets, self.kv_spec.block_size
        num_seqs, num_tokens = len(b.q_lens), len(b.token_ids)
        if b.is_decode:
            padded_tokens = rows = pick(bk.seq_buckets, num_seqs)
            piece_len = 1
        elif b.logits_indices is not None:  # speculative verification: a row per token
            padded_tokens = rows = pick(bk.verify_buckets, num_tokens)
            piece_len = VERIFY_Q_LEN  # k <= 7 drafts + the last token
        else:
            padded_tokens = pick(bk.token_buckets, num_tokens)
            rows = bk.prefill_rows(padded_tokens)
            piece_len = bk.query_block
        pages = pick(bk.page_buckets, max(-(-int(k) // page) for k in b.kv_lens))
        table = np.zeros((num_seqs, pages), np.int32)
        for i, blocks in enumerate(b.block_tables):
            n = min(len(blocks), pages)
            table[i, :n] = blocks[:n]

        seq_of_token = np.repeat(np.arange(num_seqs), b.q_lens)
        pos = b.positions.astype(np.int64)
        slots = table[seq_of_token, pos // page].astype(np.int64) * page + pos % page
        slot_mapping = np.full(padded_tokens, self.kv_spec.num_blocks * page, np.int32)
        slot_mapping[:num_tokens] = slots

        # Split each sequence's queries into pieces of <= piece_len tokens (each a row of attention).
        pieces = -(-b.q_lens // piece_len)
        piece_seq = np.repeat(np.arange(num_seqs), pieces)
        piece_first = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        piece_rank = np.arange(len(piece_seq)) - piece_first[piece_seq]
        seq_start = np.concatenate([[0], np.cumsum(b.q_lens)[:-1]])
        piece_start = seq_start[piece_seq] + piece_rank * piece_len
        piece_end = np.minimum(piece_start + piece_len, (seq_start + b.q_lens)[piece_seq])
        kv_start = (b.kv_lens - b.q_lens)[piece_seq]
        if b.is_decode:
            num_pieces = rows
        elif b.logits_indices is not None:  # one attention row per sequence (its <= 8 tokens)
            num_pieces = bk.prefill_rows(padded_tokens)  # >= sequences: each has >= 1 token
        else:
            num_pieces = bk.prefill_pieces(padded_tokens)
        cu_q_lens = np.full(num_pieces + 1, num_tokens, np.int32)
        cu_q_lens[0] = 0
        cu_q_lens[1:len(piece_seq) + 1] = piece_end
        kv_lens = np.zeros(num_pieces, np.int32)
        kv_lens[:len(piece_seq)] = kv_start + (piece_end - seq_start[piece_seq])
        page_indices = np.zeros((num_pieces, pages), np.int32)
        page_indices[:len(piece_seq)] = table[piece_seq]

        def pad(x: np.ndarray, n: int, fill: float | int = 0, dtype: type = np.int32) -> np.ndarray:
            out = np.full((n, *x.shape[1:]), fill, dtype)
            out[:len(x)] = x
            return out

        logits_indices = np.cumsum(b.q_lens) - 1 if b.logits_indices is None else b.logits_indices
        sample_positions = b.positions[logits_indices] + 1
        sampling = SamplingInputs(
            temperature=pad(b.temperature, rows, 0.0, np.float32), top_k=pad(b.top_k, rows),
            top_p=pad(b.top_p, rows, 1.0, np.float32), min_p=pad(b.min_p, rows, 0.0, np.float32),
            seeds=pad(b.seeds, rows, 0, np.uint32), sample_index=pad(b.sample_index, rows),
            positions=pad(sample_positions, rows), processed=pad(b.processed, rows, False, np.bool_),
            suppress_ids=pad(b.suppress_ids, rows, -1))
        return DeviceBatch(
            token_ids=pad(b.token_ids, padded_tokens), positions=pad(b.positions, padded_tokens),
            md=AttentionMetadata(slot_mapping=slot_mapping, kv_lens=kv_lens, page_indices=page_indices,
                                 cu_q_lens=cu_q_lens, num_seqs=np.array([len(piece_seq)], np.int32),
                                 max_q_len=piece_len),
            logits_indices=pad(logits_indices, rows), sampling=sampling,
            mode=np.int32(self._mode(b)),
            target_ids=pad(b.target_ids if b.target_ids is not None else np.zeros(0, np.int32), padded_tokens))

    @staticmethod
    def _mode(b: StepBatch) -> int:
        if np.all(b.temperature == 0) and not np.any(b.processed):
            return SAMPLER_MODES.index("greedy")
        filtering = np.any((b.top_k > 0) | (b.top_p < 1.0) | (b.min_p > 0.0))
        return SAMPLER_MODES.index("filtered" if filtering else "random")

    def warmup(self, *, prompt_logprobs: bool = False, speculative_k: int = 0) -> int:
        """Compile every bucket by running dummy steps whose K/V writes are all dropped; returns the count.

        `prompt_logprobs=True` also compiles the prefill programs that return per-token logprobs;
        `speculative_k > 0` the verification programs (a sampled row per token).
        """
        bk = self.buckets
        shapes = [(True, s, p) for s, p in itertools.product(bk.seq_buckets, bk.page_buckets)]
        shapes += [(False, t, p) for t, p in itertools.product(bk.token_buckets, bk.page_buckets)]
        tops = (0, 1) if self.max_logprobs > 0 else (0,)
        count = 0
        for (decode, n, pages), top in itertools.product(shapes, tops):
            dummy = dataclasses.replace(self._dummy(decode, n, pages), num_top_logprobs=top)
            variants = [dummy]
            if prompt_logprobs and not decode:
                variants.append(dataclasses.replace(dummy, target_ids=np.zeros_like(dummy.token_ids)))
            for step in variants:
                self.run(step)
                count += 1
        if speculative_k:
            for n, top in itertools.product(bk.verify_buckets, tops):
                if n <= bk.max_num_seqs * (speculative_k + 1):
                    self.run(self._dummy_verify(n, bk.page_buckets[-1], speculative_k, top))
                    count += 1
        return count

    def _dummy_verify(self, n: int, pages: int, k: int, num_top: int) -> StepBatch:
        """A verification step of `n` tokens: sequences of k + 1 tokens, a sampled row per token."""
        q_len = min(k + 1, n)
        num_seqs = max(1, n // q_len)
        base = self._dummy(True, num_seqs, pages)
        rows = num_seqs * q_len
        capacity = pages * self.kv_spec.block_size
        rep = lambda x: np.repeat(x, q_len, axis=0)  # noqa: E731
        return dataclasses.replace(
            base, token_ids=np.zeros(rows, np.int32),
            positions=np.tile(np.arange(capacity - q_len, capacity, dtype=np.int32), num_seqs),
            q_lens=np.full(num_seqs, q_len, np.int32), temperature=rep(base.temperature), top_k=rep(base.top_k),
            top_p=rep(base.top_p), min_p=rep(base.min_p), seeds=rep(base.seeds), sample_index=rep(base.sample_index),
            processed=rep(base.processed), suppress_ids=rep(base.suppress_ids), num_top_logprobs=num_top,
            logits_indices=np.arange(rows, dtype=np.int32))

    def _dummy(self, decode: bool, n: int, pages: int) -> StepBatch:
        """A step of bucket shape (n sequences for decode, n tokens for prefill; `pages` of context)."""
        capacity = pages * self.kv_spec.block_size
        if decode:
            q_lens = np.ones(n, np.int32)
        else:
            num_seqs = min(-(-n // capacity), self.buckets.max_num_seqs)
            q_lens = np.full(num_seqs, min(capacity, n // num_seqs), np.int32)
        num_seqs = len(q_lens)
        kv_lens = np.full(num_seqs, capacity, np.int32)
        positions = np.concatenate([np.arange(k - q, k) for k, q in zip(kv_lens, q_lens)]).astype(np.int32)
        ones = np.ones(num_seqs, np.float32)
        drop = self.kv_spec.num_blocks  # a block id past the cache: every write is dropped
        return StepBatch(
            token_ids=np.zeros(len(positions), np.int32), positions=positions, q_lens=q_lens, kv_lens=kv_lens,
            block_tables=[[drop] * pages] * num_seqs, temperature=ones, top_k=np.zeros(num_seqs, np.int32),
            top_p=ones, min_p=0 * ones, seeds=np.zeros(num_seqs, np.uint32),
            sample_index=np.zeros(num_seqs, np.int32), processed=np.zeros(num_seqs, bool),
            suppress_ids=np.full((num_seqs, MAX_SUPPRESS), -1, np.int32))
