"""The collectors' exception root and the errors several subsystems share.

Every error the collectors raise on purpose is a `CollectorError`; each message says what
happened and what to do. The CLI turns them into one-line messages at one edge
(`cli.options.Commands`). Subsystem errors live with their subsystem (`PolicyServerError` in
`collectors.policy`, `ChatError` in `collectors.proxy`, `RequestError` in
`collectors.embedded`, `TaskFileError` and `RewardError` in `collectors.collect`,
`NotFound` and `FilterError` in `collectors.viewer`, `CalculatorError` in
`collectors.envs.arithmetic`); the one `BadRequest` every HTTP server of the collectors
raises (with its status) is in `collectors.serving`. Each derives from `CollectorError`.
"""

from __future__ import annotations


class CollectorError(Exception):
    """Base class of every error the collectors raise on purpose."""


class EngineError(CollectorError):
    """The embedded server's engine could not serve a request (a failed forward pass, or it was closed)."""


class WeightLoadError(CollectorError):
    """A checkpoint could not be loaded; the server keeps serving the weights it had."""


class VersionConflict(WeightLoadError):
    """A reload must carry a policy version above the one being served (versions only go up)."""
