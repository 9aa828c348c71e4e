"""The model, prompts and engine shared by the two-process test and its single-process reference."""

from __future__ import annotations

from flax import nnx

from rollout import Engine, SamplingParams
from runner.models.config import ModelConfig
from runner.models.llama import LlamaForCausalLM

CFG = ModelConfig(family="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=8)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40))]
SAMPLING = SamplingParams(temperature=0, max_tokens=8, logprobs=0)


class IdTokenizer:
    """Prompts are token-id lists; text is not needed."""

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 96 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def make_engine(mesh: tuple[int, int] | None) -> Engine:
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(3))
    return Engine.from_model(model, IdTokenizer(), mesh=mesh, max_num_seqs=8, max_model_len=96,
                             max_num_batched_tokens=64, block_size=8)
