"""An OpenAI-compatible HTTP server over one `Engine` (vLLM's request and response shapes).

Run it with `python -m rollout.serve --model PATH` (see `__main__.py`); build it in-process with
`build_app(engine, model_name=...)`. Needs the `serve` extra (FastAPI, uvicorn).
"""

from rollout.serve.app import build_app

__all__ = ["build_app"]
