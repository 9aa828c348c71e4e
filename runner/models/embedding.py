"""Embedding rows by token id, for the model families: a gather that stays in the table's own bits
(XLA:CPU gathers a bfloat16 table through a float32 copy of all of it). A backend may read them from its
packed copy of a tied embedding instead (`runner.backends.base.EmbeddingRows`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def embedding_rows(table: Float[Array, "V H"], ids: Int[Array, "..."]) -> Float[Array, "... H"]:
    """`table[ids]`; a bfloat16 table is gathered as its uint16 bits (XLA:CPU otherwise converts the whole
    table to float32 in every step that gathers from it: 22 ms per decode call for SmolLM2). Gradients
    are those of `table[ids]`."""
    return _bf16_rows(table, ids) if table.dtype == jnp.bfloat16 else table[ids]


@jax.custom_vjp
def _bf16_rows(table: Float[Array, "V H"], ids: Int[Array, "..."]) -> Float[Array, "... H"]:
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(table, jnp.uint16)[ids], jnp.bfloat16)


def _bf16_rows_forward(table: Array, ids: Array) -> tuple[Array, tuple[Array, Array]]:
    return _bf16_rows(table, ids), (table, ids)


def _bf16_rows_backward(res: tuple[Array, Array], g: Array) -> tuple[Array, None]:
    table, ids = res
    return jnp.zeros_like(table).at[ids].add(g.astype(table.dtype)), None


_bf16_rows.defvjp(_bf16_rows_forward, _bf16_rows_backward)
