"""Stall-free chunked prefill: a step-time model and the prefill token budget it allows.

A continuous step runs decodes (one token each) and prefill chunks in one forward, so every
decode in it waits for the whole step. Sarathi-Serve (Agrawal et al., "Taming Throughput-Latency
Tradeoff in LLM Inference with Sarathi-Serve", OSDI '24) bounds that wait by giving each step a
token budget derived from the TPOT target: decodes first, then as many prefill tokens as keep the
step within the target ("stall-free batching"); long prompts are chunked across steps.

The step time is modelled as linear in the tokens of each kind and in the attention they do::

    time_s ~= base_s + per_decode_token_s * decode_tokens + per_prefill_token_s * prefill_tokens
              + per_attended_pair_s * attended_pairs

fit by weighted least squares over a bounded window of observed steps, newer steps weighing more
(exponential forgetting with a half-life in steps, so a changed backend is followed), after
dropping outliers (residuals beyond a few median absolute deviations: a GC pause or a page fault
must not move the fit). A coefficient that comes out negative is pinned to 0 and the others refit.

``attended_pairs`` counts the (query, key) pairs of the step's attention: a chunk of ``n`` tokens
at position ``p`` attends ``n * p + n * (n + 1) / 2`` (:func:`attended_pairs`), a decode at
position ``p`` ``p + 1``. The term matters: SmolLM2-135M, float32 eager, one thread, 4 decodes
beside a chunk, medians of 7 interleaved repeats on the 2-core EPYC: a 64-token chunk took 174 ms
at position 0 and 276 ms at 1,472, a 256-token chunk 613 and 933 ms at 0 and 1,280, a 16-token
one 76 and 110 ms at 0 and 1,520: about 1 us a pair, against 2.4 ms a prefill token, so 60 % more
per prompt token deep in a 2,048-token bucket.

The budget: with ``D`` decodes in the step attending ``K`` pairs and a target ``T``, prefill
chunks get ``T - predict(D, 0, K)`` seconds, each chunk the most tokens ``n`` whose
``per_prefill_token_s * n + per_attended_pair_s * attended_pairs(p, n)`` fits what is left
(:class:`PrefillRoom`), within ``max_tokens`` and never, over the step, fewer than
``min_tokens``. With no decode running the room is ``max_tokens`` alone (nobody waits). With no
target configured, ``T`` is ``decode_only_factor`` times the predicted decode-only step
with the same decodes (the batcher passes 3: :data:`buckets.continuous.STALL_FREE_DECODE_FACTOR`). Pure
arithmetic: the caller feeds step durations it measured with its own clock.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

_NUM_COEFFICIENTS = 4  # base, per decode token, per prefill token, per attended pair
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MIN_WEIGHT = 1e-3  # the least weight of a kept step, however old (see StepTimeModel)


def attended_pairs(position: int, num_tokens: int) -> int:
    """The (query, key) pairs ``num_tokens`` tokens at ``position`` on attend (causal: each token
    attends to every earlier token and itself)."""
    return num_tokens * position + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepTimeSample:
    """One observed step: tokens of each kind, attended pairs and its duration in seconds."""

    num_decode_tokens: int
    num_prefill_tokens: int
    num_attended_pairs: int
    seconds: float


@dataclass(frozen=True)
class StepTimeFit:
    """The fitted coefficients (seconds, seconds per token or pair) and the samples they came from.

    ``has_prefill`` is whether any inlier sample held prefill tokens (without one
    ``per_prefill_token_s`` is unknown, reported as 0).
    """

    base_s: float
    per_decode_token_s: float
    per_prefill_token_s: float
    per_attended_pair_s: float
    num_samples: int
    num_outliers: int
    has_prefill: bool

    def predict_s(self, num_decode_tokens: int, num_prefill_tokens: int, num_attended_pairs: int = 0) -> float:
        """Predicted seconds of a step with these tokens and attended pairs."""
        return (
            self.base_s + self.per_decode_token_s * num_decode_tokens + self.per_prefill_token_s * num_prefill_tokens
            + self.per_attended_pair_s * num_attended_pairs
        )

    def chunk_s(self, position: int, num_tokens: int) -> float:
        """Predicted seconds a prefill chunk of ``num_tokens`` at ``position`` adds to a step."""
        return self.per_prefill_token_s * num_tokens + self.per_attended_pair_s * attended_pairs(position, num_tokens)

    def chunk_tokens_within(self, seconds: float, position: int) -> int:
        """The most tokens a chunk at ``position`` may have so that :meth:`chunk_s` stays within
        ``seconds``: the root of ``(c/2) n^2 + (b + c (p + 1/2)) n = seconds``. Needs a positive
        ``per_prefill_token_s``."""
        if seconds <= 0:
            return 0
        b, c = self.per_prefill_token_s, self.per_attended_pair_s
        linear = b + c * (position + 0.5)
        if c <= 0:
            return math.floor(seconds / b + 1e-6)  # + rounding slack
        return math.floor((-linear + math.sqrt(linear * linear + 2 * c * seconds)) / c + 1e-6)


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
    residuals = [abs(s.seconds - _predict(first, s)) for s in samples]
    median_s = _median([s.seconds for s in samples])
    limit = max(outlier_mads * _MAD_TO_SIGMA * _median(residuals), 0.01 * abs(median_s))
    keep = [i for i, r in enumerate(residuals) if r <= limit]
    if len(keep) < 2 or len(keep) == len(samples):
        return first
    fit = _fit([samples[i] for i in keep], [weights[i] for i in keep])
    return dataclasses.replace(fit, num_outliers=len(samples) - len(keep))


def _predict(fit: StepTimeFit, sample: StepTimeSample) -> float:
    return fit.predict_s(sample.num_decode_tokens, sample.num_prefill_tokens, sample.num_attended_pairs)


def _fit(samples: list[StepTimeSample], weights: list[float]) -> StepTimeFit:
    """Weighted least squares with non-negative slopes: a negative coefficient is pinned to 0."""
    rows = [(1.0, float(s.num_decode_tokens), float(s.num_prefill_tokens), float(s.num_attended_pairs)) for s in samples]
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
    base_s, per_decode_token_s, per_prefill_token_s, per_attended_pair_s = coefficients
    return StepTimeFit(base_s, per_decode_token_s, per_prefill_token_s, per_attended_pair_s, len(samples), 0, has_prefill)


def _solve_normal_equations(
    rows: list[tuple[float, float, float, float]], ys: list[float], weights: list[float], free: list[int]
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

    Steps with prefill tokens and decode-only steps are kept apart, ``window`` of each, so a
    long run of decodes never forgets the prefill slope: old steps weigh little (never less
    than ``MIN_WEIGHT``) in the base and decode terms, while the prefill terms come from the
    steps with prefill alone.

    Args:
        window: the most recent steps kept of each kind (older ones are forgotten entirely).
        half_life_steps: a step's weight halves every this many newer steps (of either kind).
        refit_every: refit after this many new steps (a fit costs O(window)).
        outlier_mads: see :func:`fit_step_time`.
    Raises:
        ValueError: a non-positive argument.
    """

    def __init__(self, window: int = 64, half_life_steps: float = 32.0, refit_every: int = 8, outlier_mads: float = 4.0):
        if window < 2 or half_life_steps <= 0 or refit_every < 1 or outlier_mads <= 0:
            raise ValueError(
                f"window {window}, half_life_steps {half_life_steps}, refit_every {refit_every}, "
                f"outlier_mads {outlier_mads}: need window >= 2 and the others positive"
            )
        # (step number, sample), oldest first: decode-only steps, and steps with prefill.
        self._decode_only: collections.deque[tuple[int, StepTimeSample]] = collections.deque(maxlen=window)
        self._with_prefill: collections.deque[tuple[int, StepTimeSample]] = collections.deque(maxlen=window)
        self._num_steps = 0
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._refit_every = refit_every
        self._outlier_mads = outlier_mads
        self._num_new = 0
        self._fit: StepTimeFit | None = None

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, num_attended_pairs: int, seconds: float) -> None:
        """Record one step (called by the batcher after each forward with its measured duration)."""
        if num_decode_tokens + num_prefill_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        kept = self._with_prefill if num_prefill_tokens > 0 else self._decode_only
        kept.append((self._num_steps, StepTimeSample(num_decode_tokens, num_prefill_tokens, num_attended_pairs, seconds)))
        self._num_steps += 1
        self._num_new += 1
        if self._fit is None or self._num_new >= self._refit_every:
            self.refit()

    def refit(self) -> None:
        """Fit the kept steps now."""
        kept = [*self._decode_only, *self._with_prefill]
        weights = [max(MIN_WEIGHT, self._decay ** (self._num_steps - 1 - step_no)) for step_no, _ in kept]
        self._fit = fit_step_time([sample for _, sample in kept], weights, self._outlier_mads)
        self._num_new = 0

    @property
    def fit(self) -> StepTimeFit | None:
        """The current fit; ``None`` before two steps were observed."""
        return self._fit


class PrefillRoom:
    """One step's room for prefill chunks, asked chunk by chunk (by the scheduler, in the order it
    schedules them). Without a time limit (``room_s`` ``None``) only ``max_tokens`` bounds it.

    Args:
        fit: the step-time model (needed with a ``room_s``, with a positive prefill slope).
        room_s: predicted seconds left for prefill in the step; ``None``: no time limit.
        max_tokens: prefill tokens the step may hold at most.
        min_tokens: prefill tokens the step gets at least (within ``max_tokens``), whatever the time.
    """

    def __init__(self, fit: StepTimeFit | None, room_s: float | None, max_tokens: int, min_tokens: int) -> None:
        if room_s is not None and (fit is None or fit.per_prefill_token_s <= 0):
            raise ValueError("room_s: a time limit needs a fit with a positive prefill slope")
        self.fit = fit
        self.room_s = room_s
        self.num_tokens_left = max(0, max_tokens)
        self.min_tokens = min_tokens
        self.num_granted = 0

    def tokens_for(self, position: int, max_tokens: int) -> int:
        """The most tokens (<= ``max_tokens``) a chunk starting at ``position`` may take now."""
        cap = min(max_tokens, self.num_tokens_left)
        if self.room_s is None or self.fit is None:
            return max(0, cap)
        floor = max(0, self.min_tokens - self.num_granted)
        return max(0, min(cap, max(floor, self.fit.chunk_tokens_within(self.room_s, position))))

    def take(self, position: int, num_tokens: int) -> None:
        """Charge a scheduled chunk (negative ``num_tokens``: give back a chunk of ``-num_tokens``
        at ``position``, for a sequence preempted after it was scheduled)."""
        self.num_tokens_left -= num_tokens
        self.num_granted += num_tokens
        if self.room_s is not None and self.fit is not None:
            sign = 1 if num_tokens >= 0 else -1
            self.room_s -= sign * self.fit.chunk_s(position, abs(num_tokens))


class StallFreeBudget:
    """The prefill room the scheduler opens each step, from a fed :class:`StepTimeModel`.

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
        self.last_target_s: float | None = None  # the target of the last step opened
        # Sequences of other buckets on the same slice that decode and wait out this bucket's
        # steps (the slice's worker steps one bucket at a time); None: no neighbours.
        self.neighbour_decodes: Callable[[], int] | None = None

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, num_attended_pairs: int, seconds: float) -> None:
        """Feed one step's measured duration to the model (the batcher, after each forward)."""
        self.model.observe(num_decode_tokens, num_prefill_tokens, num_attended_pairs, seconds)

    def target_s(self, num_decode_tokens: int, num_attended_pairs: int = 0) -> float | None:
        """The step-time target with these decodes; ``None`` while unknown."""
        if self.target_step_s is not None:
            return self.target_step_s
        fit = self.model.fit
        return None if fit is None else self.decode_only_factor * fit.predict_s(num_decode_tokens, 0, num_attended_pairs)

    def open_step(self, num_decode_tokens: int, num_attended_pairs: int, max_tokens: int) -> PrefillRoom:
        """The prefill room of a step whose decodes (``num_decode_tokens`` of them, attending
        ``num_attended_pairs``) are scheduled, with ``max_tokens`` of the step's cap left (called
        by the scheduler once per step). No time limit when nothing decodes, here or in a bucket
        beside it on the slice (:attr:`neighbour_decodes`), or nothing is known
        yet (no fit, or no prefill seen)."""
        fit = self.model.fit
        # A step with no decodes of its own still stalls a neighbour's decoding streams: it is then
        # held to the target of a step with their decodes (this bucket's model predicting them).
        waiting = num_decode_tokens if num_decode_tokens > 0 else self._num_neighbour_decodes()
        target = self.last_target_s = self.target_s(waiting, num_attended_pairs) if waiting > 0 else None
        if waiting <= 0 or fit is None or not fit.has_prefill or fit.per_prefill_token_s <= 0 or target is None:
            return PrefillRoom(None, None, max_tokens, self.min_prefill_tokens)
        room_s = target - fit.predict_s(num_decode_tokens, 0, num_attended_pairs)
        return PrefillRoom(fit, room_s, max_tokens, self.min_prefill_tokens)

    def _num_neighbour_decodes(self) -> int:
        return self.neighbour_decodes() if self.neighbour_decodes is not None else 0
