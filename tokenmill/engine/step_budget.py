"""A per-step prompt-token budget for a step-time target (EngineConfig.step_time_target_ms).

A step that runs decodes holds up every running request's next token for as long as it takes, so
with a target set, such a step takes only the prompt tokens a step-time model predicts still fit
under the target beside its decodes (at least `min_tokens`, so prefills always progress; never more
than the scheduler's own caps). A step without decodes is not limited: nobody waits on it.

The model is linear in the step's shape, in milliseconds:

    t(num_tokens, num_reqs) = a + b * num_tokens + c * num_reqs

a: the fixed cost of a step (host preparation, launches, the sampler's fixed part); b: the cost of a
token through every layer (the linear layers' work grows with the tokens); c: the cost of a request
(its logits row through the LM head, its sampling row, its attention program). Attention over the
context is not a term of its own; the online fit absorbs its average. Decode-only steps have
num_reqs == num_tokens, so they cannot separate b from c: the calibration's timed forward passes
(tokens varied at one request and at many) can, and the online fit is anchored to them.

Calibration: at start-up, timed dummy forward passes over a few shapes (the median of a few runs
of each, after one untimed run that absorbs any compile), fit by least squares. On CUDA each timing
is bracketed by device synchronisations; that is start-up only.

Online: each completed step's measured duration (StepClock: host timestamps on the CPU, CUDA
events on the stream on CUDA; no device synchronisation either way) updates an exponentially
weighted least-squares fit (forgetting factor `forgetting` per step), regularised towards the
calibrated coefficients: `prior_weight` calibration points' worth at first, forgotten like the
data down to `prior_floor`, so the first steps cannot swing the fit, yet later the measured steps
dominate, while a direction they do not excite keeps its calibrated value instead of drifting.
Each observation is Huber-weighted: a residual beyond `huber_k` times a running scale (at least
`relative_scale` of the prediction) counts at that bound only, so a step that included a Triton
compile or a page fault moves the fit little. `rescale_after` clipped residuals of one sign in a
row are a lasting change of speed instead (a calibration under load, say): the calibrated
coefficients are scaled to match those steps and the online fit restarts from them. Coefficients
are kept non-negative (a cost is never negative), and planning never takes a prompt token for less
than a quarter of its calibrated cost.

A known limit: attention over earlier context (a late chunk of a long prompt, decodes of long
requests) is in no term (the dummy passes attend over their own tokens only), so the online fit
carries its average; steps whose contexts are much longer than usual run over the prediction until
the fit has seen them.
"""

import logging
import statistics
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from tokenmill.logger import init_logger

logger = init_logger(__name__)


Vector = list[float]
Matrix = list[list[float]]


def _solve(A: Matrix, rhs: Vector) -> Vector:
    """A x = rhs for a small dense system (Gaussian elimination with partial pivoting; plain floats:
    this runs once a step, where numpy's per-call overhead would dominate a 3 x 3 solve)."""
    n = len(rhs)
    M = [list(A[i]) + [rhs[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(M[i][col]))
        M[col], M[pivot] = M[pivot], M[col]
        p = M[col][col]
        if p == 0.0:
            raise ZeroDivisionError("singular system")
        for i in range(col + 1, n):
            f = M[i][col] / p
            if f:
                row, top = M[i], M[col]
                for j in range(col, n + 1):
                    row[j] -= f * top[j]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (M[i][n] - sum(M[i][j] * x[j] for j in range(i + 1, n))) / M[i][i]
    return x


def _solve_nonnegative(A: Matrix, rhs: Vector) -> Vector:
    """x >= 0 for the quadratic whose normal equations are A x = rhs (A symmetric positive definite,
    3 x 3): solve, and while a coefficient comes out negative, pin the most negative one at 0 and
    solve for the others (a greedy active set, not a full NNLS; enough for three terms)."""
    free = list(range(len(rhs)))
    sub = _solve(A, rhs)
    while min(sub) < 0.0:
        free.pop(sub.index(min(sub)))
        if not free:
            return [0.0] * len(rhs)
        sub = _solve([[A[i][j] for j in free] for i in free], [rhs[i] for i in free])
    x = [0.0] * len(rhs)
    for i, v in zip(free, sub):
        x[i] = v
    return x


class StepTimeModel:
    """t(num_tokens, num_reqs) ~ a + b * num_tokens + c * num_reqs milliseconds, fit from timed
    calibration runs and updated online from measured steps (see the module docstring)."""

    def __init__(self, forgetting: float = 0.98, prior_weight: float = 8.0, prior_floor: float = 0.5,
                 huber_k: float = 3.0, relative_scale: float = 0.2, scale_rate: float = 0.05,
                 rescale_after: int = 5):
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.forgetting = forgetting
        self.prior_weight = prior_weight
        self.prior_floor = min(prior_floor, prior_weight)
        self.huber_k = huber_k
        self.scale_rate = scale_rate
        self.relative_scale = relative_scale
        self.rescale_after = max(1, rescale_after)
        self.coef: Vector = [0.0, 0.0, 0.0]  # a (ms), b (ms per token), c (ms per request)
        self.calibrated = False
        self.num_observations = 0  # online observations taken
        self.num_outliers = 0  # of which Huber-clipped
        self.num_rescales = 0  # lasting changes of speed followed (see _rescale)
        self._prior: Vector = [0.0, 0.0, 0.0]
        self._prior_info: Matrix = [[0.0] * 3 for _ in range(3)]  # the calibration's, one point's worth
        self._prior_rhs: Vector = [0.0, 0.0, 0.0]  # _prior_info @ _prior
        self._prior_strength = 0.0  # points' worth: prior_weight, forgotten like data down to prior_floor
        self._S: Matrix = [[0.0] * 3 for _ in range(3)]  # sum of forgetting^age * w * x x^T, online
        self._r: Vector = [0.0, 0.0, 0.0]  # sum of forgetting^age * w * x * y
        self._scale = 0.0  # running scale of |residual| (ms)
        self._streak = 0  # consecutive clipped residuals of one sign (+n slower, -n faster than predicted)
        self._recent: deque[tuple[float, float, float, float]] = deque(maxlen=self.rescale_after)  # t, r, ms, pred
        self._dirty = False

    @property
    def a(self) -> float:
        return self._coef()[0]

    @property
    def b(self) -> float:
        return self._coef()[1]

    @property
    def c(self) -> float:
        return self._coef()[2]

    @property
    def token_cost(self) -> float:
        """The cost of a prompt token (ms) for planning: b, but no less than a quarter of the
        calibrated b, so that steps of a narrow range of shapes (decodes, short chunks) with noisy
        times, which can fit b near 0, never make a long prefill look free."""
        return max(self._coef()[1], 0.25 * self._prior[1])

    def predict(self, num_tokens: float, num_reqs: float) -> float:
        """Predicted step time in milliseconds."""
        a, b, c = self._coef()
        return a + b * num_tokens + c * num_reqs

    def fit(self, samples: Sequence[tuple[int, int, float]]) -> None:
        """Calibrate from (num_tokens, num_reqs, milliseconds) samples: a non-negative least-squares
        fit, which becomes the prior of the online fit; online statistics start afresh."""
        if not samples:
            raise ValueError("calibration needs at least one sample")
        X = np.array([(1.0, float(t), float(r)) for t, r, _ in samples])
        y = np.array([ms for _, _, ms in samples], dtype=np.float64)
        # A little ridge keeps the system definite when the shapes do not span all three terms.
        info = X.T @ X
        info += 1e-9 * np.diag(np.maximum(np.diag(info), 1.0))
        coef = _solve_nonnegative(info.tolist(), (X.T @ y).tolist())
        self.coef, self._prior = list(coef), list(coef)
        prior_info = info / len(samples)
        self._prior_strength = self.prior_weight
        self._prior_info = prior_info.tolist()
        self._prior_rhs = (prior_info @ np.array(coef)).tolist()
        self._S = [[0.0] * 3 for _ in range(3)]
        self._r = [0.0, 0.0, 0.0]
        residuals = y - X @ np.array(coef)
        self._scale = max(float(np.sqrt(np.mean(residuals ** 2))), 1e-3)
        self._streak = 0
        self._recent.clear()
        self.calibrated = True
        self._dirty = False

    def observe(self, num_tokens: int, num_reqs: int, ms: float) -> None:
        """One measured step: update the online fit (Huber-weighted, exponentially forgetting)."""
        if not self.calibrated or not ms >= 0.0:
            return
        x = (1.0, float(num_tokens), float(num_reqs))
        a, b, c = self._coef()
        predicted = a + b * x[1] + c * x[2]
        residual = ms - predicted
        bound = self.huber_k * max(self._scale, self.relative_scale * abs(predicted), 1e-3)
        weight = 1.0
        if abs(residual) > bound:
            weight = bound / abs(residual)
            self.num_outliers += 1
            sign = 1 if residual > 0 else -1
            self._streak = self._streak + sign if self._streak * sign > 0 else sign
        else:
            self._streak = 0
        self._recent.append((x[1], x[2], ms, predicted))
        if abs(self._streak) >= self.rescale_after:
            self._rescale()
            return
        self._scale += self.scale_rate * (min(abs(residual), bound) - self._scale)
        lam, S, r = self.forgetting, self._S, self._r
        for i in range(3):
            wx = weight * x[i]
            row = S[i]
            for j in range(3):
                row[j] = lam * row[j] + wx * x[j]
            r[i] = lam * r[i] + wx * ms
        self._prior_strength = max(self.prior_floor, lam * self._prior_strength)
        self.num_observations += 1
        self._dirty = True

    def _rescale(self) -> None:
        """rescale_after clipped residuals of one sign in a row are no stalls but a lasting change
        of speed (the calibration ran under load, or real steps replay graphs the calibration's
        passes did not): scale the calibrated coefficients by the median measured / predicted
        ratio of those steps, restart the online fit from them at full prior weight, and take
        those steps in."""
        recent = list(self._recent)
        factor = statistics.median(ms / pred if pred > 0 else 1.0 for _, _, ms, pred in recent)
        self._prior = [v * factor for v in self._prior]
        self._prior_rhs = [v * factor for v in self._prior_rhs]
        self._prior_strength = self.prior_weight
        self._S = [[0.0] * 3 for _ in range(3)]
        self._r = [0.0, 0.0, 0.0]
        for t, r, ms, _ in recent:
            x = (1.0, t, r)
            for i in range(3):
                for j in range(3):
                    self._S[i][j] += x[i] * x[j]
                self._r[i] += x[i] * ms
        self._dirty = True
        self._scale = max(statistics.median(abs(ms - self.predict(t, r)) for t, r, ms, _ in recent), 1e-3)
        self._streak = 0
        self._recent.clear()
        self.num_observations += len(recent) > 0
        self.num_rescales += 1

    def _coef(self) -> Vector:
        if self._dirty:
            S, P, w = self._S, self._prior_info, self._prior_strength
            A = [[S[i][j] + w * P[i][j] for j in range(3)] for i in range(3)]
            self.coef = _solve_nonnegative(A, [self._r[i] + w * self._prior_rhs[i] for i in range(3)])
            self._dirty = False
        return self.coef

    def __str__(self) -> str:
        a, b, c = self._coef()
        return f"{a:.3f} ms + {b * 1e3:.3f} us/token + {c * 1e3:.3f} us/request"


class StepClock:
    """Step durations measured without any device synchronisation on the step path.

    synchronous (CPU): the runner computes the step during the launch calls, so a step takes from
    the start of its launch (execute_model) to their end (sample_tokens returned).

    Otherwise (CUDA, steps queued on a stream): a CUDA event recorded on the stream at each end of
    the launch. The stream reaches the first when the step before has finished (or at once, if the
    device was idle: the host's preparation of the step then counts, as it should) and the second
    when the step's last kernel has run, so their elapsed time is the step's own time. It is read
    once the step's results are in on the host (the engine waits for those anyway), when both have
    completed: reading it waits for nothing. The plain host interval between completions would not
    do: when the device waits on the host, the host's preparation of step N + 1 falls between the
    completions of N - 1 and N and is counted as N's (seen on the H200: a decode step of 1.3 ms
    measured 24 ms beside the launch of an eager 2552-token step). Should an event not be complete,
    that interval is the fallback: from the later of the step's launch and the previous
    completion, to this one.
    """

    def __init__(self, synchronous: bool, events: Optional[bool] = None):
        """events: time with CUDA events (default: when not synchronous); without them the host
        interval alone."""
        self.synchronous = synchronous
        # in flight: (launch start, launch end, start event, end event)
        self._launches: deque[tuple[float, float, Any, Any]] = deque()
        self._begin = 0.0
        self._begin_event: Any = None
        self._last_end: Optional[float] = None
        self._free_events: list[Any] = []
        self._torch: Any = None
        if (not synchronous) if events is None else events:
            import torch

            self._torch = torch

    def _event(self) -> Any:
        if self._free_events:
            return self._free_events.pop()
        return self._torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        """Just before a step's launch (execute_model)."""
        self._begin = time.perf_counter()
        if self._torch is not None:
            self._begin_event = self._event()
            self._begin_event.record()

    def launched(self) -> None:
        """Just after the step's launch ended (sample_tokens returned): it is in flight."""
        end_event = None
        if self._torch is not None:
            end_event = self._event()
            end_event.record()
        self._launches.append((self._begin, time.perf_counter(), self._begin_event, end_event))
        self._begin_event = None

    def completed(self) -> float:
        """The oldest in-flight step's results are in: its duration in milliseconds."""
        done = time.perf_counter()
        start, launch_end, start_event, end_event = self._launches.popleft()
        end = launch_end if self.synchronous else done
        if self._last_end is not None and self._last_end > start:
            start = self._last_end
        self._last_end = end
        ms = max(0.0, (end - start) * 1e3)
        if end_event is not None:
            if start_event.query() and end_event.query():
                ms = start_event.elapsed_time(end_event)
            self._free_events += (start_event, end_event)
        return ms


# target "auto": the larger of a floor that holds inter-token latency p99 near 30 ms on serve-8b
# (docs/PERFORMANCE.md) and twice the calibrated decode step, so that prompts still get room beside
# the decodes of a model whose decode step alone is near the floor.
AUTO_TARGET_MIN_MS = 22.0
AUTO_TARGET_DECODE_FACTOR = 2.0


def auto_target_ms(model: "StepTimeModel", decode_batch: int) -> float:
    """The "auto" target for a calibrated model: max(AUTO_TARGET_MIN_MS, AUTO_TARGET_DECODE_FACTOR x
    the predicted decode step of decode_batch requests)."""
    decode_ms = model.predict(decode_batch, decode_batch)
    return max(AUTO_TARGET_MIN_MS, AUTO_TARGET_DECODE_FACTOR * decode_ms)


class StepBudget:
    """The prompt tokens a step with decodes may take under a step-time target (milliseconds),
    and the measurements that keep its model current (synchronous: the runner computes each step
    during its launch, as on the CPU; else steps run on a CUDA stream, timed with events).

    target_ms "auto": chosen at calibration (auto_target_ms over a decode of max_reqs requests).
    Before calibration it limits nothing and learns nothing (the engine's own warm-up steps, with
    their compiles, run then)."""

    def __init__(self, target_ms: Union[float, str], max_tokens: int, min_tokens: int = 16,
                 model: Optional[StepTimeModel] = None, synchronous: bool = True):
        self.auto = target_ms == "auto"
        if self.auto:
            target_ms = AUTO_TARGET_MIN_MS  # until calibrate() chooses it
        elif isinstance(target_ms, str) or not target_ms > 0:
            raise ValueError(f"target_ms must be > 0 or 'auto', got {target_ms!r}")
        self.target_ms = float(target_ms)
        self.max_tokens = int(max_tokens)
        self.min_tokens = max(1, min(int(min_tokens), self.max_tokens))
        self.model = model or StepTimeModel()
        self.clock = StepClock(synchronous)

    def prefill_cap(self, num_decode_tokens: int, num_reqs: int) -> int:
        """Prompt tokens that fit under the target in a step that already runs num_decode_tokens
        decode tokens, num_reqs requests in all (decodes and the prefills to come); within
        [min_tokens, max_tokens]."""
        model = self.model
        if not model.calibrated:
            return self.max_tokens
        room = self.target_ms - model.predict(num_decode_tokens, num_reqs)
        b = model.token_cost
        if b <= 0.0:  # tokens cost nothing the model can see
            return self.max_tokens if room > 0 else self.min_tokens
        return max(self.min_tokens, min(self.max_tokens, int(room / b)))

    # ---- measurements (the engine's step path, only with a target set) ----------------------
    def begin(self) -> None:
        self.clock.begin()

    def launched(self) -> None:
        self.clock.launched()

    def completed(self, num_tokens: int, num_reqs: int) -> None:
        ms = self.clock.completed()
        self.model.observe(num_tokens, num_reqs, ms)

    # ---- start-up ---------------------------------------------------------------------------
    def calibrate(self, run: Callable[[int, int], None], sync: Callable[[], None], max_tokens: int,
                  max_reqs: int, repeats: int = 3, time_budget_s: float = 0.5) -> None:
        """Time `run(num_tokens, num_reqs)` (a dummy forward pass) over a few shapes up to
        max_tokens / max_reqs and fit the model. Shapes run from cheapest to dearest; after the
        first three (the model needs three), a shape whose runs would take the calibration past
        its time budget (estimated from the last shape's time, in proportion to the tokens) and
        every shape after it are skipped. `sync` waits for the device (a no-op on the CPU)."""
        started = time.perf_counter()
        samples: list[tuple[int, int, float]] = []
        shapes = calibration_shapes(max_tokens, max_reqs)
        for i, (num_tokens, num_reqs) in enumerate(shapes):
            if i >= 3:
                last_tokens, _, last_ms = samples[-1]
                expected_s = (repeats + 1) * last_ms * max(1.0, num_tokens / last_tokens) / 1e3
                if time.perf_counter() - started + expected_s > time_budget_s:
                    break
            run(num_tokens, num_reqs)  # untimed: absorbs a compile or a first-touch
            sync()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run(num_tokens, num_reqs)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            samples.append((num_tokens, num_reqs, statistics.median(times)))
        self.model.fit(samples)
        if self.auto:
            self.target_ms = auto_target_ms(self.model, max(1, max_reqs))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step-time calibration samples (tokens, requests, ms): %s",
                         [(t, r, round(ms, 3)) for t, r, ms in samples])
        logger.info("step-time target %.1f ms%s: step time model %s (from %d shapes in %.2f s); a step with "
                    "decodes takes at least %d prompt tokens", self.target_ms,
                    f" (auto: a decode of {max_reqs} requests predicted at {self.model.predict(max_reqs, max_reqs):.1f}"
                    " ms)" if self.auto else "", self.model, len(samples), time.perf_counter() - started,
                    self.min_tokens)

    def calibrate_runner(self, runner, max_tokens: int, max_reqs: int) -> None:
        """calibrate() on a model runner's dummy forward passes: on CUDA through the piecewise CUDA
        graphs where they cover the shape, as real steps run, each timing device-synchronised."""
        import torch

        device = runner.device
        on_gpu = device.type == "cuda"
        sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
        self.calibrate(lambda num_tokens, num_reqs: runner.dummy_run(num_tokens, num_reqs, piecewise=on_gpu),
                       sync, max_tokens, max_reqs, time_budget_s=0.5)


def calibration_shapes(max_tokens: int, max_reqs: int) -> list[tuple[int, int]]:
    """(num_tokens, num_reqs) shapes to time, cheapest first: token counts 16, 64, 256, ... up to
    max_tokens (and max_tokens itself), each as one request (a prefill) and as many requests
    (decode-like), so the fit can tell the cost of a token from the cost of a request."""
    max_tokens, max_reqs = max(1, max_tokens), max(1, max_reqs)
    counts = []
    n = 16
    while n < max_tokens:
        counts.append(n)
        n *= 4
    counts.append(max_tokens)
    if len(counts) == 1 and max_tokens > 1:
        counts.insert(0, max(1, max_tokens // 4))
    shapes: list[tuple[int, int]] = []
    for n in counts:
        for r in (1, min(n, max_reqs)):
            if (n, r) not in shapes:
                shapes.append((n, r))
    return shapes
