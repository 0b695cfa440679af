"""The errors ``ddp`` raises: each is a ``commlib.CommError``, so one ``except CommError`` catches all."""

from __future__ import annotations

from commlib.errors import CollectiveMismatchError, CommError

__all__ = [
    "AbandonedBackwardError",
    "CommHookError",
    "MissingGradientsError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "UnsupportedCollectiveError",
]


class ModelMismatchError(CollectiveMismatchError):
    """The ranks' models differ (parameter names, shapes, dtypes or count)."""


class MissingGradientsError(CommError):
    """Backward ended without some parameters' gradients, and ``find_unused_parameters`` was off."""


class AbandonedBackwardError(CommError):
    """A backward raised before its end, so the ranks may disagree on which collectives were issued."""


class NonFiniteGradientError(CommError):
    """A gradient held NaN or Inf before communication (``check_for_nan_in_grad=True``).

    Every rank raises it in the same backward, after every bucket's collective has
    finished, so no rank steps on the bad gradients and none is left waiting.

    Attributes:
        ranks: The ranks whose local gradients were not finite.
        buckets: ``{rank: [bucket index, ...]}`` where each of those ranks found them.
        parameters: ``{rank: [parameter name, ...]}`` (at most a few per rank).
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        buckets: dict[int, list[int]] | None = None,
        parameters: dict[int, list[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.buckets = dict(buckets or {})
        self.parameters = dict(parameters or {})


class CommHookError(CommError):
    """A communication hook was misused (registered twice or too late) or did not deliver a result."""


class UnsupportedCollectiveError(CommError, ValueError):
    """The process group cannot run a collective the settings need (found at construction, before any)."""
