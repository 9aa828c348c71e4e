"""A mixture-of-experts feed-forward block (Qwen3-MoE): softmax routing to the top-k experts per token,
the chosen (token, expert) pairs sorted by expert and computed as grouped matmuls (`jax.lax.ragged_dot`:
each expert multiplies only its own tokens, never a dense all-experts product). A step with at most
`num_experts` (token, expert) pairs (decode at small batch) instead gathers each pair's expert weights
and multiplies them directly: it reads only the chosen experts, which is what a memory-bound decode
step pays for. XLA:CPU lowers `ragged_dot` to a masked product over every expert, so the CPU backend
("segments") loops over row windows of each expert's segment, or, where nearly every expert is chosen
anyway (fewer than `SEGMENTS_FROM` pairs per expert), multiplies every expert once. Where the step is mapped
over data-parallel replicas (on a mesh), jax 0.10.2 has no batching rule for `ragged_dot`: there every
expert runs on every token, weighted by the routing (exact, E / k times the work).

The experts' weights are stacked per projection (`experts.gate_proj.kernel [E, in, out]`, ...): the name
table maps HF's per-expert tensors to entries of the leading axis (`NameEntry.stacked`), and the sharding
rules split that axis over the mesh's `model` axis (expert parallelism)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from runner.models.activations import silu
from runner.models.config import ModelConfig


# "segments" (the CPU backend) loops over row windows from this many (token, expert) pairs per expert; from
# one to this many it multiplies every expert densely (each expert's weights are read once either way)
SEGMENTS_FROM = 4


class ExpertWeight(nnx.Module):
    """A `[in, out]` kernel read by the block (the router), or `[E, in, out]`: one per expert."""

    def __init__(self, in_features: int, out_features: int, *, cfg: ModelConfig, rngs: nnx.Rngs,
                 num_experts: int | None = None):
        init = jax.nn.initializers.normal(stddev=0.02)
        shape = (in_features, out_features) if num_experts is None else (num_experts, in_features, out_features)
        self.kernel = nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


class Experts(nnx.Module):
    """Every expert's SwiGLU weights, stacked: `down(silu(gate(x)) * up(x))` with expert e's `[e]` slices."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.gate_proj = ExpertWeight(h, i, cfg=cfg, rngs=rngs, num_experts=e)
        self.up_proj = ExpertWeight(h, i, cfg=cfg, rngs=rngs, num_experts=e)
        self.down_proj = ExpertWeight(i, h, cfg=cfg, rngs=rngs, num_experts=e)


class SparseMoE(nnx.Module):
    """Routed experts in place of a layer's MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.gate = ExpertWeight(cfg.hidden_size, cfg.num_experts, cfg=cfg, rngs=rngs)  # the router
        self.experts = Experts(cfg, rngs)
        # the grouped matmul the backend picked: "ragged_dot" (XLA), JAX's Megablox `gmm` kernel on a TPU
        # ("megablox"; "megablox_interpret" runs it in Pallas interpret mode anywhere), or "segments"
        # (the CPU backend's: a loop over fixed-size row windows of each expert's segment, `_segments`)
        self.grouped_matmul = "ragged_dot"

    def route(self, x: Float[Array, "N H"]) -> tuple[Float[Array, "N k"], jax.Array]:
        """Each token's `num_experts_per_tok` experts and their weights (softmax in float32, as HF)."""
        cfg = self.config
        logits = jnp.dot(x, self.gate.kernel[...].astype(x.dtype)).astype(jnp.float32)
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights.astype(x.dtype), experts

    def __call__(self, x: Float[Array, "... H"]) -> Float[Array, "... H"]:
        return self.routed(x)[0]

    def routed(self, x: Float[Array, "... H"]) -> tuple[Float[Array, "... H"], Int[Array, "N k"]]:
        """The block's output and the experts each token was routed to (N = the tokens of `x`)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        pairs, num_experts = flat.shape[0] * self.config.num_experts_per_tok, self.config.num_experts
        if pairs <= num_experts:
            out = self._gathered(flat, weights, experts)
        elif self.grouped_matmul == "segments" and pairs < SEGMENTS_FROM * num_experts:
            # nearly every expert is chosen: reading each once (the dense product) is what the step costs anyway
            out = self._dense(flat, weights, experts)
        else:
            try:
                out = self._grouped(flat, weights, experts)
            except NotImplementedError:  # jax 0.10.2's ragged_dot cannot be vmapped here (mapped over mesh replicas)
                out = self._dense(flat, weights, experts)
        return out.reshape(x.shape), experts

    def _stacked(self, name: str, dtype: jnp.dtype) -> Float[Array, "E A B"]:
        return getattr(self.experts, name).kernel[...].astype(dtype)

    def _grouped(self, x: Float[Array, "N H"], weights: Float[Array, "N k"], experts: Int[Array, "N k"]
                 ) -> Float[Array, "N H"]:
        """(token, expert) pairs sorted by expert, one grouped matmul per projection."""
        k = self.config.num_experts_per_tok
        order = jnp.argsort(experts.reshape(-1), stable=True)
        token = order // k
        sizes = jnp.bincount(experts.reshape(-1), length=self.config.num_experts).astype(jnp.int32)
        xs = x[token]
        if self.grouped_matmul == "segments":
            ys = self._segments(xs, sizes) * weights.reshape(-1)[order][:, None]
            return jnp.zeros_like(x).at[token].add(ys)
        h = (silu(self._gmm(xs, self._stacked("gate_proj", x.dtype), sizes))
             * self._gmm(xs, self._stacked("up_proj", x.dtype), sizes))
        ys = self._gmm(h, self._stacked("down_proj", x.dtype), sizes) * weights.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[token].add(ys)

    def _gathered(self, x: Float[Array, "N H"], weights: Float[Array, "N k"], experts: Int[Array, "N k"]
                  ) -> Float[Array, "N H"]:
        """Each (token, expert) pair multiplied by that expert's own weights, gathered per pair."""
        chosen = experts.reshape(-1)
        xs = jnp.repeat(x, self.config.num_experts_per_tok, axis=0)

        def project(name: str, inputs: Array) -> Array:
            kernels = getattr(self.experts, name).kernel[...][chosen].astype(x.dtype)
            return jnp.einsum("pa,pab->pb", inputs, kernels)
        h = silu(project("gate_proj", xs)) * project("up_proj", xs)
        ys = project("down_proj", h) * weights.reshape(-1)[:, None]
        return ys.reshape(x.shape[0], -1, x.shape[1]).sum(axis=1)

    def _segments(self, xs: Float[Array, "P H"], sizes: Int[Array, "E"]) -> Float[Array, "P H"]:
        """The expert MLP of rows sorted by expert (`sizes` each), one window of `rows` rows of one expert's
        segment per loop iteration (E + P / rows iterations; each reads its expert's weights): the work
        of the chosen (token, expert) pairs only, where XLA:CPU's `ragged_dot` multiplies every row by
        every expert. Rows of a window past its segment are computed and dropped."""
        num_pairs, num_experts = xs.shape[0], self.config.num_experts
        rows = int(min(64, max(8, 1 << max(0, (num_pairs // num_experts - 1).bit_length()))))
        starts = jnp.cumsum(sizes) - sizes
        padded = jnp.pad(xs, ((0, rows), (0, 0)))
        gate, up, down = (self._stacked(n, xs.dtype) for n in ("gate_proj", "up_proj", "down_proj"))

        def body(state: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            e, window, out = state
            start = starts[e] + window * rows
            x = jax.lax.dynamic_slice_in_dim(padded, start, rows)
            y = (silu(x @ gate[e]) * (x @ up[e])) @ down[e]
            keep = (jnp.arange(rows) < sizes[e] - window * rows)[:, None]
            out = jax.lax.dynamic_update_slice_in_dim(
                out, jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, start, rows)), start, 0)
            more = (window + 1) * rows < sizes[e]
            return jnp.where(more, e, e + 1), jnp.where(more, window + 1, 0), out

        init = (jnp.int32(0), jnp.int32(0), jnp.zeros_like(padded))
        return jax.lax.while_loop(lambda state: state[0] < num_experts, body, init)[2][:num_pairs]

    def _gmm(self, lhs: Float[Array, "M K"], rhs: Float[Array, "E K N"], group_sizes: Int[Array, "E"]
             ) -> Float[Array, "M N"]:
        """Rows of `lhs` (grouped by expert, `group_sizes` each) times their group's `rhs`."""
        if not self.grouped_matmul.startswith("megablox"):
            return jax.lax.ragged_dot(lhs, rhs, group_sizes)
        from jax.experimental.pallas.ops.tpu.megablox import gmm

        (m, k), n = lhs.shape, rhs.shape[2]
        tile_m = 8  # rows come padded to the TPU's sublane tile; K and N in 128-lane tiles where they divide
        padded = jnp.pad(lhs, ((0, -m % tile_m), (0, 0)))
        tiling = (tile_m, 128 if k % 128 == 0 else k, 128 if n % 128 == 0 else n)
        out = gmm(padded, rhs, group_sizes, preferred_element_type=jnp.float32, tiling=tiling,
                  interpret=self.grouped_matmul == "megablox_interpret")
        return out[:m].astype(lhs.dtype)

    def _dense(self, x: Float[Array, "N H"], weights: Float[Array, "N k"], experts: Int[Array, "N k"]
               ) -> Float[Array, "N H"]:
        """Every expert on every token, weighted by the routing (zero where not chosen): the same sums."""
        per_expert = jnp.zeros((x.shape[0], self.config.num_experts), x.dtype)
        per_expert = per_expert.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
        # x broadcast over the experts: a batched matmul reads each `[E, in, out]` kernel as it is stored
        # (with x unbatched, XLA:CPU transposed every expert kernel in every step)
        xs = jnp.broadcast_to(x, (self.config.num_experts, *x.shape))
        h = (silu(jnp.einsum("enh,ehi->eni", xs, self._stacked("gate_proj", x.dtype)))
             * jnp.einsum("enh,ehi->eni", xs, self._stacked("up_proj", x.dtype)))
        y = jnp.einsum("eni,eih->enh", h, self._stacked("down_proj", x.dtype))
        return jnp.einsum("ne,enh->nh", per_expert, y)
