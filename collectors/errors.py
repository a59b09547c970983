"""The collectors' named exceptions; each message says what happened and what to do."""

from __future__ import annotations

from trajstore.errors import TrajstoreError


class CollectorError(TrajstoreError):
    """Base class of every error the collectors raise on purpose."""


class EngineError(CollectorError):
    """The embedded server's engine could not serve a request (a failed forward pass, or it was closed)."""


class WeightLoadError(CollectorError):
    """A checkpoint could not be loaded; the server keeps serving the weights it had."""


class VersionConflict(WeightLoadError):
    """A reload must carry a policy version above the one being served (versions only go up)."""
