"""A small OpenEnv environment served for the tests (run with the python of `.venv-envs`, where openenv-core is):

    .venv-envs/bin/python -m uvicorn tests.collectors.envs.openenv_server_for_tests:app --port PORT

Spell: reset(seed) picks a word; each step's action `message` is rewarded by how alike it is to the
word (difflib's ratio, so even a random model's replies differ); the episode ends after `rounds` steps
or an exact answer. Each WebSocket session is its own instance.
"""

from __future__ import annotations

import difflib
import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ("apple", "river", "stone", "cloud", "ember", "maple", "quartz", "violet")


class SpellAction(Action):
    message: str = Field(..., description="the reply")


class SpellObservation(Observation):
    prompt: str = Field(default="", description="what the model is shown")


class Spell(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self, rounds: int = 2) -> None:
        self.rounds, self.word = rounds, ""
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SpellObservation:
        self.word = random.Random(seed).choice(WORDS)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SpellObservation(prompt=f"Say the word: {self.word}", done=False, reward=0.0)

    def step(self, action: SpellAction, **kwargs: Any) -> SpellObservation:  # type: ignore[override]
        self._state.step_count += 1
        said = action.message.strip()
        reward = difflib.SequenceMatcher(None, said, self.word).ratio()
        done = said == self.word or self._state.step_count >= self.rounds
        return SpellObservation(prompt=f"Not quite. Say the word: {self.word}", done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(Spell, SpellAction, SpellObservation, env_name="spell", max_concurrent_envs=64)
