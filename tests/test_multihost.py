"""Two local processes (JAX's multi-process runtime, gloo CPU collectives) generate what one process does.

Every process runs the same host-side scheduler on the same prompts (SPMD, like any JAX
multi-controller program) and every process gets all outputs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from multihost_common import PROMPTS, SAMPLING, make_engine

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one() -> None:
    port = str(_free_port())
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(i), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        outputs.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]))
    reference = make_engine(mesh=None).generate(PROMPTS, SAMPLING)
    for result in outputs:
        for (ids, logprobs), ref in zip(result, reference):
            assert ids == ref.outputs[0].token_ids
            np.testing.assert_allclose(logprobs, [t.logprob for t in ref.outputs[0].logprobs], atol=1e-5)
