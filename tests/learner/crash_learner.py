"""The learner process of test_learner_crash: `learner.train.learn`, as `trajstore learn` runs it.

The test starts it through multiprocessing's forkserver with this module preloaded: each
attempt is then a fresh forked process (its own store writer, file locks and model), killed
with SIGKILL, without paying the seconds of importing torch and transformers every time.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers.models.qwen2.modeling_qwen2  # noqa: E402, F401  (imported lazily otherwise: the slow part)
from transformers.utils import logging as hf_logging  # noqa: E402

from learner.metrics_log import show  # noqa: E402
from learner.settings import LearnSettings  # noqa: E402
from learner.train import learn  # noqa: E402

# tqdm's progress bars create a multiprocessing lock, which a SIGKILLed process leaks
hf_logging.disable_progress_bar()


def run(settings: dict[str, Any], log: str) -> None:
    """Train with `settings` (LearnSettings fields), printing to the file `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    learn(LearnSettings(**settings), show=show)
