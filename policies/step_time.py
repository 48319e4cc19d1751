"""Stall-free chunked prefill: a step-time model and the prefill token budget it allows.

A continuous step runs decodes (one token each) and prefill chunks in one forward, so every
decode in it waits for the whole step. Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", OSDI '24) bounds that wait by giving each step a
token budget derived from the TPOT target: decodes first, then as many prefill tokens as keep the
step within the target ("stall-free batching"); long prompts are chunked across steps.

The step time is modelled as linear in the tokens of each kind::

    time_s ~= base_s + per_decode_token_s * decode_tokens + per_prefill_token_s * prefill_tokens

fit by weighted least squares over a bounded window of observed steps, newer steps weighing more
(exponential forgetting with a half-life in steps, so a changed backend is followed), after
dropping outliers (residuals beyond a few median absolute deviations: a GC pause or a page fault
must not move the fit). A coefficient that comes out negative is pinned to 0 and the others refit.
Attention over the attended context also costs per token, growing with context length; at the
lengths the buckets serve the GEMMs dominate, so the model has no context term.

The budget with ``D`` decodes in the step and a target ``T`` is
``floor((T - base_s - per_decode_token_s * D) / per_prefill_token_s)``, clamped to
``[min_tokens, max_tokens]``; with no decode running it is ``max_tokens`` (nobody waits). With no
target configured, ``T`` is twice the predicted decode-only step with the same ``D`` decodes.
Pure arithmetic: the caller feeds step durations it measured with its own clock.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

_NUM_COEFFICIENTS = 3  # base, per decode token, per prefill token
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True)
class StepTimeSample:
    """One observed step: tokens of each kind and its duration in seconds."""

    num_decode_tokens: int
    num_prefill_tokens: int
    seconds: float


@dataclass(frozen=True)
class StepTimeFit:
    """The fitted coefficients (seconds, seconds per token) and the samples they came from.

    ``has_prefill`` is whether any inlier sample held prefill tokens (without one
    ``per_prefill_token_s`` is unknown, reported as 0).
    """

    base_s: float
    per_decode_token_s: float
    per_prefill_token_s: float
    num_samples: int
    num_outliers: int
    has_prefill: bool

    def predict_s(self, num_decode_tokens: int, num_prefill_tokens: int) -> float:
        """Predicted seconds of a step with these tokens."""
        return self.base_s + self.per_decode_token_s * num_decode_tokens + self.per_prefill_token_s * num_prefill_tokens


def fit_step_time(samples: list[StepTimeSample], weights: list[float], outlier_mads: float = 4.0) -> StepTimeFit | None:
    """Robust weighted least-squares fit of :class:`StepTimeFit` to ``samples``.

    Fits all samples, drops those whose residual exceeds ``outlier_mads`` robust standard
    deviations (``1.4826 * MAD``, at least 1 % of the median step time, so noise-free data keeps
    its inliers), and refits the rest. ``weights`` (one per sample, > 0) are the forgetting.

    Returns:
        ``None`` with fewer than 2 samples.
    Raises:
        ValueError: ``samples`` and ``weights`` differ in length.
    """
    if len(samples) != len(weights):
        raise ValueError(f"weights: {len(weights)} weights for {len(samples)} samples")
    if len(samples) < 2:
        return None
    first = _fit(samples, weights)
    residuals = [abs(s.seconds - first.predict_s(s.num_decode_tokens, s.num_prefill_tokens)) for s in samples]
    median_s = _median([s.seconds for s in samples])
    limit = max(outlier_mads * _MAD_TO_SIGMA * _median(residuals), 0.01 * abs(median_s))
    keep = [i for i, r in enumerate(residuals) if r <= limit]
    if len(keep) < 2 or len(keep) == len(samples):
        return first
    fit = _fit([samples[i] for i in keep], [weights[i] for i in keep])
    return StepTimeFit(
        fit.base_s, fit.per_decode_token_s, fit.per_prefill_token_s, len(keep), len(samples) - len(keep), fit.has_prefill
    )


def _fit(samples: list[StepTimeSample], weights: list[float]) -> StepTimeFit:
    """Weighted least squares with non-negative slopes: a negative coefficient is pinned to 0."""
    rows = [(1.0, float(s.num_decode_tokens), float(s.num_prefill_tokens)) for s in samples]
    ys = [s.seconds for s in samples]
    free = list(range(_NUM_COEFFICIENTS))
    while True:
        solved = _solve_normal_equations(rows, ys, weights, free)
        coefficients = [0.0] * _NUM_COEFFICIENTS
        for index, value in zip(free, solved):
            coefficients[index] = value
        negative = [i for i in free if coefficients[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: coefficients[i]))
        if not free:
            break
    has_prefill = any(s.num_prefill_tokens > 0 for s in samples)
    return StepTimeFit(coefficients[0], coefficients[1], coefficients[2], len(samples), 0, has_prefill)


def _solve_normal_equations(
    rows: list[tuple[float, float, float]], ys: list[float], weights: list[float], free: list[int]
) -> list[float]:
    """Solve ``(X'WX + ridge) c = X'Wy`` over the ``free`` columns by Gaussian elimination. A tiny
    ridge keeps a column that never varies (all zero, or constant beside the base) solvable."""
    size = len(free)
    matrix = [[sum(w * r[i] * r[j] for r, w in zip(rows, weights)) for j in free] for i in free]
    vector = [sum(w * r[i] * y for r, w, y in zip(rows, weights, ys)) for i in free]
    for k in range(size):
        matrix[k][k] += 1e-9 * matrix[k][k] + 1e-12
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(matrix[r][col]))
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        vector[col], vector[pivot] = vector[pivot], vector[col]
        for row in range(col + 1, size):
            factor = matrix[row][col] / matrix[col][col]
            for k in range(col, size):
                matrix[row][k] -= factor * matrix[col][k]
            vector[row] -= factor * vector[col]
    solution = [0.0] * size
    for row in reversed(range(size)):
        known = sum(matrix[row][k] * solution[k] for k in range(row + 1, size))
        solution[row] = (vector[row] - known) / matrix[row][row]
    return solution


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class StepTimeModel:
    """The step-time model of one bucket, refit online from the steps it is fed.

    Args:
        window: the most recent steps kept (older ones are forgotten entirely).
        half_life_steps: a step's weight halves every this many newer steps.
        refit_every: refit after this many new steps (a fit costs O(window)).
        outlier_mads: see :func:`fit_step_time`.
    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(self, window: int = 128, half_life_steps: float = 32.0, refit_every: int = 8, outlier_mads: float = 4.0):
        if window < 2 or half_life_steps <= 0 or refit_every < 1 or outlier_mads <= 0:
            raise ValueError(
                f"window {window}, half_life_steps {half_life_steps}, refit_every {refit_every}, "
                f"outlier_mads {outlier_mads}: need window >= 2 and the others positive"
            )
        self._samples: collections.deque[StepTimeSample] = collections.deque(maxlen=window)
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._refit_every = refit_every
        self._outlier_mads = outlier_mads
        self._num_new = 0
        self._fit: StepTimeFit | None = None

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """Record one step (called by the batcher after each forward with its measured duration)."""
        if num_decode_tokens + num_prefill_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._samples.append(StepTimeSample(num_decode_tokens, num_prefill_tokens, seconds))
        self._num_new += 1
        if self._fit is None or self._num_new >= self._refit_every:
            self.refit()

    def refit(self) -> None:
        """Fit the kept steps now."""
        num = len(self._samples)
        weights = [self._decay ** (num - 1 - i) for i in range(num)]
        self._fit = fit_step_time(list(self._samples), weights, self._outlier_mads)
        self._num_new = 0

    @property
    def fit(self) -> StepTimeFit | None:
        """The current fit; ``None`` before two steps were observed."""
        return self._fit


def max_prefill_tokens(
    fit: StepTimeFit | None, num_decode_tokens: int, target_s: float | None, max_tokens: int, min_tokens: int
) -> int:
    """The most prefill tokens a step with ``num_decode_tokens`` decodes may take so that its
    predicted time stays within ``target_s`` (Sarathi-Serve's token budget), within
    ``[min(min_tokens, max_tokens), max_tokens]``.

    ``max_tokens`` (the step's token cap left after the decodes) when nothing decodes, when the
    fit or its prefill slope is not known yet, or when ``target_s`` is ``None``.
    """
    max_tokens = max(0, max_tokens)
    if num_decode_tokens <= 0 or fit is None or not fit.has_prefill or fit.per_prefill_token_s <= 0 or target_s is None:
        return max_tokens
    room_s = target_s - fit.predict_s(num_decode_tokens, 0)
    tokens = math.floor(room_s / fit.per_prefill_token_s + 1e-6) if room_s > 0 else 0  # + rounding slack
    return max(min(min_tokens, max_tokens), min(tokens, max_tokens))


class StallFreeBudget:
    """The prefill budget the scheduler asks for each step, from a fed :class:`StepTimeModel`.

    Args:
        target_step_s: the step-time target (the bucket's TPOT target) in seconds; ``None``:
            ``decode_only_factor`` times the predicted decode-only step with the same decodes.
        min_prefill_tokens: the floor of a step's prefill tokens (one KV block), so a prompt
            always progresses even when the decodes alone reach the target.
        model: the step-time model (a new one by default).
        decode_only_factor: see ``target_step_s``.
    Raises:
        ValueError: ``target_step_s`` or ``decode_only_factor`` not positive, or
            ``min_prefill_tokens`` below 1.
    """

    def __init__(
        self,
        target_step_s: float | None,
        min_prefill_tokens: int,
        model: StepTimeModel | None = None,
        decode_only_factor: float = 2.0,
    ) -> None:
        if target_step_s is not None and target_step_s <= 0:
            raise ValueError(f"target_step_s: {target_step_s} is not positive")
        if min_prefill_tokens < 1 or decode_only_factor <= 0:
            raise ValueError(f"min_prefill_tokens {min_prefill_tokens}, decode_only_factor {decode_only_factor}")
        self.target_step_s = target_step_s
        self.min_prefill_tokens = min_prefill_tokens
        self.model = model or StepTimeModel()
        self.decode_only_factor = decode_only_factor
        self.last_target_s: float | None = None  # the target of the last budget asked for

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float) -> None:
        """Feed one step's measured duration to the model (the batcher, after each forward)."""
        self.model.observe(num_decode_tokens, num_prefill_tokens, seconds)

    def target_s(self, num_decode_tokens: int) -> float | None:
        """The step-time target with ``num_decode_tokens`` decodes; ``None`` while unknown."""
        if self.target_step_s is not None:
            return self.target_step_s
        fit = self.model.fit
        return None if fit is None else self.decode_only_factor * fit.predict_s(num_decode_tokens, 0)

    def max_prefill_tokens(self, num_decode_tokens: int, max_tokens: int) -> int:
        """The prefill tokens a step with ``num_decode_tokens`` decodes may take, at most
        ``max_tokens`` (called by the scheduler once per step)."""
        target = self.last_target_s = self.target_s(num_decode_tokens)
        return max_prefill_tokens(self.model.fit, num_decode_tokens, target, max_tokens, self.min_prefill_tokens)
