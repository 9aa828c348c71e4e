"""One process of the two-process test: `python multihost_worker.py PROCESS_ID PORT` prints its outputs as JSON."""

from __future__ import annotations

import json
import sys

import jax


def main() -> None:
    process_id, port = int(sys.argv[1]), sys.argv[2]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from multihost_common import PROMPTS, SAMPLING, make_engine

    engine = make_engine(mesh=(1, 2))  # one CPU device per process: a global 2-device mesh
    outs = engine.generate(PROMPTS, SAMPLING)
    result = [[o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs]] for o in outs]
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
