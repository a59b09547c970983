"""Small text environments with the gymnasium API, for the text-environment adapter's tests."""

from __future__ import annotations

import difflib
import re
import string
from typing import Any

import gymnasium
from gymnasium import spaces

MAX_TEXT = 200


class GuessNumber(gymnasium.Env):  # type: ignore[misc]
    """Guess a hidden number in 1..high: each guess is answered "higher", "lower" or "correct".

    A step's reward is 1.0 for the right guess, -0.1 for a wrong one (a number in the reply),
    -0.2 for a reply with no number; the episode ends on the right guess or after `tries`."""

    def __init__(self, high: int = 10, tries: int = 3) -> None:
        self.high, self.tries = high, tries
        self.observation_space = spaces.Text(MAX_TEXT, charset=string.printable)
        self.action_space = spaces.Text(MAX_TEXT, charset=string.printable)
        self.secret, self.left = 0, 0
        self.closed = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(1, self.high + 1))
        self.left = self.tries
        return f"Guess my number from 1 to {self.high}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        found = re.findall(r"\d+", action)
        if not found:
            return "Say a number.", -0.2, False, self.left == 0, {}
        guess = int(found[-1])
        if guess == self.secret:
            return "correct", 1.0, True, False, {}
        return ("higher" if guess < self.secret else "lower"), -0.1, False, self.left == 0, {}

    def close(self) -> None:
        self.closed = True


class NotText(GuessNumber):
    """Observations that are not text: the adapter must say so, not crash later."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        return [1, 2, 3], {}


class Echo(GuessNumber):
    """Repeat a word, `rounds` times: each step's reward is how alike the reply and the word are (difflib's
    ratio, 0 to 1), so even a random model's episodes differ in reward and a learner gets a signal."""

    WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon")

    def __init__(self, rounds: int = 2) -> None:
        super().__init__(tries=rounds)
        self.word = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return self._next(), {}

    def _next(self) -> str:
        self.word = str(self.np_random.choice(self.WORDS))
        return f"Say {self.word}."

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        score = difflib.SequenceMatcher(None, action.strip().lower(), self.word).ratio()
        return self._next(), score, self.left == 0, False, {}


gymnasium.register("TestGuessNumber-v0", entry_point=GuessNumber)
