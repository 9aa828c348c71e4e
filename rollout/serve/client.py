"""What a trainer in another process calls to push new policy weights to a running server."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

import numpy as np


def push_weights(url: str, tensors: Mapping[str, np.ndarray], token: str, *, version: int | None = None,
                 mapping: str = "hf", recompute_running: bool = False, timeout: float = 600.0) -> int | None:
    """POST `tensors` (HF names -> arrays, float32/float16; bfloat16 travels as float32) to the server's
    `/update_weights` as one safetensors body; returns the server's policy version. Raises `RuntimeError`
    with the server's message if it refused them (its weights are then unchanged)."""
    from safetensors.numpy import save

    body = save({k: np.ascontiguousarray(v if v.dtype in (np.float32, np.float16) else np.asarray(v, np.float32))
                 for k, v in ((k, np.asarray(v)) for k, v in tensors.items())})
    query = {"mapping": mapping, "recompute_running": str(recompute_running).lower()}
    if version is not None:
        query["version"] = str(version)
    request = urllib.request.Request(f"{url.rstrip('/')}/update_weights?{urllib.parse.urlencode(query)}", data=body,
                                     headers={"authorization": f"Bearer {token}",
                                              "content-type": "application/octet-stream"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())["policy_version"]
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"/update_weights answered {err.code}: {err.read().decode(errors='replace')}") from err
