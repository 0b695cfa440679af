"""The errors ``ddp`` raises: each is a ``commlib.CommError``, so one ``except CommError`` catches all."""

from __future__ import annotations

from commlib.errors import CollectiveMismatchError, CommError

__all__ = [
    "AbandonedBackwardError",
    "BucketOrderError",
    "CommHookError",
    "EarlyTerminationError",
    "MissingGradientsError",
    "ModelMismatchError",
    "NonFiniteGradientError",
    "RepeatedGradientError",
    "ParametersChangedError",
    "RanksOutOfStepError",
    "StateNotConsolidatedError",
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
    """A communication hook was misused (registered twice or too late) or did not deliver a result.

    A hook that fails in a backward on some rank makes every rank raise it in that
    backward, after every rank issued the step's collectives.

    Attributes:
        ranks: The ranks whose hook failed in that backward (empty for a misuse).
        buckets: ``{rank: first bucket index whose hook failed there}``.
    """

    def __init__(
        self, message: str, *, ranks: tuple[int, ...] = (), buckets: dict[int, int] | None = None
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.buckets = dict(buckets or {})


class RepeatedGradientError(CommError):
    """A parameter got a second gradient in one backward (a shared or reentrant-checkpointed use).

    Without ``static_graph=True`` the first gradient has already been taken into its
    bucket, maybe sent, so a second one cannot be added; with it, the number of
    gradients each parameter gets is learnt in the first backward and a parameter that
    gets more than that in a later one raises this too (the graph changed).

    Attributes:
        parameter: The parameter's name.
        count: How many gradients it got in this backward so far.
    """

    def __init__(self, message: str, *, parameter: str = "", count: int = 0) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.count = count


class EarlyTerminationError(CommError):
    """With ``Join(..., throw_on_early_termination=True)``: a rank ran out of inputs (raised on all)."""


class RanksOutOfStepError(CollectiveMismatchError):
    """The ranks' collectives of one backward belong to different training steps.

    A rank ran a forward whose backward never reached DDP (it raised before any
    gradient, or was skipped on that rank alone), so its buckets would be averaged
    with another step's. Every rank raises it in the same backward.

    ``ZeroRedundancyOptimizer.step()`` and ``consolidate_state_dict()`` take part in
    the same agreement: a rank that skipped one, called it twice or alone makes
    every rank raise this at once (``positions`` says where each rank was).

    Attributes:
        steps: ``{rank: (training forwards, synchronised backwards)}`` of every
            rank when this backward began (for an optimizer operation: its calls, -1).
        positions: ``{rank: where it was}`` (``"in DDP's backward (training forward
            3, synchronised backward 3)"``, ``"in ZeroRedundancyOptimizer.step() (its
            call 2)"``), when some rank was not in a backward; else empty.
    """

    def __init__(
        self,
        message: str,
        *,
        steps: dict[int, tuple[int, int]] | None = None,
        positions: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.steps = dict(steps or {})
        self.positions = dict(positions or {})


class ParametersChangedError(CommError):
    """Parameters changed dtype or device, or were replaced, after they were wrapped.

    ``DistributedDataParallel`` raises it on every rank in the same backward
    (or at forward, on the rank whose parameters were replaced by new tensors,
    whose gradient hooks are gone); ``ZeroRedundancyOptimizer.step`` raises it
    when a parameter no longer lives in the optimizer's flat buffer.

    Attributes:
        ranks: The ranks whose parameters changed (as far as this rank knows).
        parameters: Names of the changed parameters this rank knows of (at most a few).
    """

    def __init__(
        self, message: str, *, ranks: tuple[int, ...] = (), parameters: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.parameters = parameters


class BucketOrderError(CommError):
    """A bucket was launched out of order, twice, or before all its gradients were ready.

    Buckets launch strictly in order so that every rank issues the same collectives.
    """


class StateNotConsolidatedError(CommError):
    """``ZeroRedundancyOptimizer.state_dict()`` was called on a rank that holds no consolidated state."""


class UnsupportedCollectiveError(CommError, ValueError):
    """The process group cannot run a collective the settings need (found at construction, before any)."""


def with_context(error: CommError, context: str) -> CommError:
    """Return an error of the same kind as ``error``, its message prefixed by ``context``."""
    try:
        return type(error)(f"{context}: {error}")
    except TypeError:
        return CommError(f"{context}: {error}")
