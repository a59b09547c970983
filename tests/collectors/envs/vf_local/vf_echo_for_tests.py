"""A local verifiers (0.4) environment for the tests, imported by verifiers in `.venv-envs` (this directory on
its PYTHONPATH; never by the project): four "say the word" tasks and a rubric of two weighted functions."""
from __future__ import annotations

import difflib
from collections.abc import Iterator

import verifiers.v1 as vf

WORDS = ("apple", "river", "stone", "cloud")


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        text = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        return difflib.SequenceMatcher(None, str(text or "").strip(), self.data.word).ratio()

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        text = trace.assistant_messages[-1].content if trace.assistant_messages else ""
        return 1.0 if len(str(text or "")) <= 12 else 0.0


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self) -> Iterator[EchoTask]:
        for word in WORDS:
            yield EchoTask(EchoData(prompt=f"Say the word: {word}", word=word), self.config.task)


__all__ = ["EchoTaskset"]
