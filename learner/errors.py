"""The learner's exception root. The CLI turns every `LearnerError` into a one-line message (`cli.main`)."""

from __future__ import annotations


class LearnerError(Exception):
    """Base class of every error the learner raises on purpose; the message says what to do."""
