"""`python -m rollout.serve --model PATH`: load a model and serve it over HTTP (OpenAI-compatible)."""

from __future__ import annotations

import argparse
import os

import uvicorn

from rollout.engine import Engine
from rollout.serve.app import build_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.serve", description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on a TPU, float32 elsewhere")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--weights-token", default=os.environ.get("ROLLOUT_WEIGHTS_TOKEN"),
                        help="bearer token that /update_weights requires (default $ROLLOUT_WEIGHTS_TOKEN; unset: disabled)")
    parser.add_argument("--no-warmup", action="store_true", help="compile step programs on first use instead")
    args = parser.parse_args(argv)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    if not args.no_warmup:
        engine.warmup(use_tqdm=True)
    name = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    uvicorn.run(build_app(engine, model_name=name, weights_token=args.weights_token), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
