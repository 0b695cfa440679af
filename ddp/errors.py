"""The errors ``ddp`` raises: each is a ``commlib.CommError``, so one ``except CommError`` catches all."""

from __future__ import annotations

from commlib.errors import CollectiveMismatchError, CommError

__all__ = ["AbandonedBackwardError", "MissingGradientsError", "ModelMismatchError"]


class ModelMismatchError(CollectiveMismatchError):
    """The ranks' models differ (parameter names, shapes, dtypes or count)."""


class MissingGradientsError(CommError):
    """Backward ended without some parameters' gradients, and ``find_unused_parameters`` was off."""


class AbandonedBackwardError(CommError):
    """A backward raised before its end, so the ranks may disagree on which collectives were issued."""
