"""The virtualenv of the ecosystem environments' own packages (`.venv-envs`, built by `make envs`).

verifiers 0.4 pins an older openai than the project's and openenv-core an older pillow, so their
servers run from a virtualenv of their own, never imported here: `$TRAJSTORE_ENVS_PYTHON` (its
python), else `.venv-envs` beside the project's virtualenv, in the checkout, or in the current
directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from collectors.errors import CollectorError

ENVS_VENV = ".venv-envs"
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


class EnvsVenvMissing(CollectorError, RuntimeError):
    """The environments' virtualenv is not built."""


def envs_python() -> Path:
    """The python of the environments' virtualenv, or EnvsVenvMissing saying how to build it."""
    configured = os.environ.get("TRAJSTORE_ENVS_PYTHON")
    if configured:
        if not Path(configured).is_file():
            raise EnvsVenvMissing(f"TRAJSTORE_ENVS_PYTHON={configured} does not exist; point it at the python of "
                                  "a virtualenv with verifiers and openenv-core (make envs builds one)")
        return Path(configured)
    for root in (Path(sys.prefix).parent, _SOURCE_ROOT, Path.cwd()):
        candidate = root / ENVS_VENV / "bin" / "python"
        if candidate.is_file():
            return candidate
    raise EnvsVenvMissing(f"no {ENVS_VENV} virtualenv found (beside the project's virtualenv, in the checkout, or "
                          "$TRAJSTORE_ENVS_PYTHON); build it with `make envs`")
