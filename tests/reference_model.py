"""The documented accumulation semantics as a plain float64 NumPy model.

The oracle of ``tests/test_reference.py``. It is written from the README ("What
happens when...", "The ready-made train step") and the ``MultiSteps``
docstring, not from the library's code:

- A micro-batch is one entry per data-parallel replica (one entry without
  ``axis_name``). It is *counted* towards ``k`` unless ``should_skip_update_fn``
  rejects its whole gradient, as one device sees it: over replicas the mean of
  their gradients weighted by their (finite, positive) weights, zeros without
  one (``"mean"``), or their sum. A rejected micro-batch is as if it never
  happened.
- A counted micro-batch whose weight is negative or not finite on any replica,
  or (``on_nonfinite="skip_micro_batch"``) whose gradient or loss is not finite
  on a replica with positive weight, adds nothing on every replica and
  increments ``skipped_micro_batches`` once. Under ``"window_mean"`` (whose
  losses are shares of the whole window's mean) a bad weight drops the whole
  window instead: it ends as a non-finite window.
- Otherwise every replica with positive weight adds ``w * g`` (``"mean"``) or
  ``g`` (``"sum"``, ``"window_mean"``) to the window's gradient sum, ``w`` to
  its weight and ``w * loss`` (or ``loss``) to its loss; weights and products
  are at least float32 whatever the accumulator dtype; sums are kept in the
  accumulator dtype.
- A streamed window ends after ``max(1, k(updates))`` counted micro-batches or
  on ``end_window=True``; a scan-mode call ends one window after its last
  micro-batch.
- A window with total weight 0 ends without an update. A window whose sums are
  not finite, or whose gradient (the sum divided by the weight with
  ``use_grad_mean``, except under ``"window_mean"``) overflows its leaf dtype,
  ends without an update and counts in ``skipped_windows``. Otherwise the
  inner optimizer (plain SGD whose learning rate is ``schedule(progress)``)
  runs once on the window gradient.
- With loss terms (``MultiSteps(terms=...)``, ``docs/loss_terms.md``; only
  ``"mean"`` with ``use_grad_mean``) each replica passes a gradient, weight and
  loss per term, and each term keeps the sums above over the window. A
  micro-batch is admitted or dropped as a unit: a bad weight in any term, or
  (``"skip_micro_batch"``) a non-finite gradient or loss in a term with
  positive weight, drops all of its terms. A term of weight 0 adds nothing.
  The window's gradient is ``sum_t A_t / W_t`` over the terms with ``W_t > 0``
  (a term of window weight 0 adds nothing), its loss the sum of those terms'
  weighted means; it applies an update when any term has weight. The metrics
  hold each term's mean and weight; ``weight``, ``window_weight`` and what
  ``progress_schedule(unit="weight")`` counts are the first term's.
- Every micro-batch of a run, whatever happens to it, gets the key
  ``jax.random.fold_in(rng, n)`` with ``n`` the number of micro-batches the run
  saw before it (``MultiStepsState.micro_batches_seen``).

Values near an overflow threshold cannot be predicted without modelling every
rounding; the model raises :class:`Ambiguous` for them and the test draws
another example.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

INT32_MAX = 2**31 - 1
#: A gradient whose first element is exactly this is rejected by the test's
#: ``should_skip_update_fn`` (exact in every float dtype used).
SENTINEL = 4096.0
DTYPES = {
  "float16": np.dtype(jnp.float16),
  "bfloat16": np.dtype(jnp.bfloat16),
  "float32": np.dtype(np.float32),
  "float64": np.dtype(np.float64),
}


def schedule(progress: Any) -> Any:
  """The learning-rate schedule of every example (works on floats and arrays)."""
  return 0.5 / (1.0 + 0.5 * progress)


def eps(dtype: Any) -> float:
  return float(jnp.finfo(dtype).eps)


def tiny(dtype: Any) -> float:
  return float(jnp.finfo(dtype).tiny)


def ulp0(dtype: Any) -> float:
  """The smallest subnormal: the absolute rounding error near 0."""
  return tiny(dtype) * eps(dtype)


def max_of(dtype: Any) -> float:
  return float(jnp.finfo(dtype).max)


def wider(a: np.dtype, b: np.dtype) -> np.dtype:
  return a if a.itemsize >= b.itemsize else b


class Ambiguous(Exception):
  """A value lies too close to an overflow threshold to predict the outcome."""


def overflows(value: float, limit: float, band: float) -> bool:
  """Whether a non-negative magnitude overflows ``limit``; raises near it."""
  if value > limit * band:
    return True
  if value < limit / band:
    return False
  raise Ambiguous(f"{value:.4g} is within a factor {band:.3f} of {limit:.4g}")


@dataclasses.dataclass(frozen=True)
class Config:
  """One drawn configuration of ``MultiSteps`` and how it is called."""

  leaves: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype)
  every_k: int | tuple[int, int]  # int, or (k at even, k at odd update counts)
  use_grad_mean: bool
  grad_reduction: str
  on_nonfinite: str
  skip_fn: bool
  accumulator_dtype: str | None
  unit: str
  per_update: float | None
  pass_weight: bool  # False: no `weight=` (MultiSteps.update paths only)
  # Per term (one entry without terms): every micro-batch's weight, if equal.
  constant_weights: tuple[float | None, ...]
  literal_weight: bool  # train steps: loss_fn returns constants as Python floats
  pass_loss: bool  # MultiSteps.update paths; train steps always pass the loss
  rng: str | None  # None, "typed" (jax.random.key) or "raw" (jax.random.PRNGKey)
  replicas: int
  x64: bool
  terms: tuple[str, ...] | None = None  # Loss terms, in their declared order.

  @property
  def term_count(self) -> int:
    return len(self.terms) if self.terms is not None else 1

  def k_at(self, updates: int) -> int:
    k = self.every_k if isinstance(self.every_k, int) else self.every_k[updates % 2]
    return max(1, k)

  def leaf_dtype(self, name: str) -> np.dtype:
    return DTYPES[dict((n, d) for n, _, d in self.leaves)[name]]

  def acc_dtype(self, name: str) -> np.dtype:
    if self.accumulator_dtype is not None:
      return DTYPES[self.accumulator_dtype]
    return wider(self.leaf_dtype(name), np.dtype(np.float32))

  @property
  def weight_dtype(self) -> np.dtype:
    dtype = np.dtype(np.float32)
    for name, _, _ in self.leaves:
      dtype = wider(dtype, self.acc_dtype(name))
    return dtype


@dataclasses.dataclass
class Term:
  """One loss term of one replica's micro-batch (values exact in their dtype).

  Without loss terms a micro-batch has one, the whole loss.
  """

  grads: dict[str, np.ndarray]  # float64 arrays holding leaf-dtype values
  weight: float
  loss: float


@dataclasses.dataclass
class Replica:
  """What one replica passes for one micro-batch."""

  terms: list[Term]  # In the declared order of ``Config.terms``.
  skip: bool


@dataclasses.dataclass
class MicroBatch:
  replicas: list[Replica]
  end_window: bool = False


@dataclasses.dataclass
class Expected:
  """What one call must return: exact counters, floats with tolerances."""

  counters: dict[str, int]
  floats: dict[str, tuple[float, float]]  # name -> (value, absolute tolerance)
  # Per term: its metrics ("loss": window mean, "weight") and the state's
  # "acc_weight" and "acc_loss" after the call.
  terms: list[dict[str, tuple[float, float]]]
  # Per term, the window sum after the call (None while it counts as empty):
  # value, tolerance and where it must be non-finite.
  acc: list[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]] | None
  # The inner optimizer's update (None: exact zeros): value and tolerance.
  update: dict[str, tuple[np.ndarray, np.ndarray]] | None
  keys: list[int]  # micro_batches_seen before each micro-batch of the call


@dataclasses.dataclass
class TermSums:
  """One term's running sums over the window (the window's, without terms)."""

  acc: dict[str, np.ndarray]
  acc_abs: dict[str, np.ndarray]  # Sum of the magnitudes added: for rounding.
  bad: dict[str, np.ndarray]  # Where the sum is not finite.
  weight: float = 0.0
  loss: float = 0.0
  loss_abs: float = 0.0
  bad_loss: bool = False
  adds: int = 0  # Micro-batches that added to it.

  @classmethod
  def empty(cls, shapes: dict[str, tuple[int, ...]]) -> TermSums:
    return cls(
      acc={n: np.zeros(s) for n, s in shapes.items()},
      acc_abs={n: np.zeros(s) for n, s in shapes.items()},
      bad={n: np.zeros(s, bool) for n, s in shapes.items()},
    )


STATS = [
  "applied",
  "skipped_window",
  "empty_window",
  "dropped",
  "window_mean_drop",
  "rejected",
  "zero_weight",
]
#: Cases of windows of loss terms: a term without weight in a micro-batch that
#: adds, a bad weight in one term only, an update with a term of weight 0, and
#: one whose first term (whose weight schedules count) has weight 0.
TERM_STATS = [
  "term_zero_in_micro_batch",
  "term_bad_weight",
  "term_without_weight",
  "first_term_without_weight",
]


class Reference:
  """The documented semantics, one call at a time."""

  def __init__(self, config: Config):
    self.config = config
    self.names = [name for name, _, _ in config.leaves]
    self.shapes = {name: shape for name, shape, _ in config.leaves}
    self.wd = config.weight_dtype
    self.mini = self.gstep = self.skipped_mb = self.skipped_w = self.seen = 0
    self.updated = False
    self.items = 0.0  # items of applied windows, for unit="weight"
    self.calls = self.window_micro = 0
    self.window_weight = 0.0
    self.lr = float(schedule(0.0))
    self.skip_step = 0
    # How often each documented case came up, so a test can check that the
    # drawn examples exercise them all.
    self.stats = dict.fromkeys(STATS + TERM_STATS, 0)
    self._empty_window()

  # -- window state ----------------------------------------------------------

  def _empty_window(self) -> None:
    self.sums = [TermSums.empty(self.shapes) for _ in range(self.config.term_count)]

  def _band(self, dtype: np.dtype, adds: int) -> float:
    return 1.02 + 4 * (adds + 2) * eps(dtype)

  @staticmethod
  def _inc(x: int) -> int:
    return min(x + 1, INT32_MAX)

  def _rejected(self, mb: MicroBatch) -> bool:
    """Whether the test's ``should_skip_update_fn`` (the first element of the
    first term's whole gradient is :data:`SENTINEL`) rejects ``mb``: drawn so
    where flagged (every replica's element the sentinel under ``"mean"``, the
    first replica's under a sum), unless no replica has a weight to average
    over or one's weight is not finite (the mean is then NaN)."""
    if not mb.replicas[0].skip:
      return False
    if len(mb.replicas) == 1 or self.config.grad_reduction != "mean":
      return True
    weights = [float(np.asarray(r.terms[0].weight, self.wd)) for r in mb.replicas]
    if not all(math.isfinite(w) for w in weights):  # Its mean is NaN.
      return False
    return any(w > 0 for w in weights)

  def _add(self, mb: MicroBatch) -> bool:
    """Adds one micro-batch; returns whether it counts towards k."""
    self.seen = self._inc(self.seen)
    self.skip_step = self.gstep
    if self._rejected(mb):
      self.stats["rejected"] += 1
      return False
    self.mini = self._inc(self.mini)
    weights = [
      [float(np.asarray(t.weight, self.wd)) for t in r.terms] for r in mb.replicas
    ]
    if self._dropped(mb, weights):
      self.skipped_mb = self._inc(self.skipped_mb)
      self.stats["dropped"] += 1
      return True
    added = 0
    for i, sums in enumerate(self.sums):
      adding = [
        (r.terms[i], w[i])
        for r, w in zip(mb.replicas, weights, strict=True)
        if w[i] > 0
      ]
      if adding:
        self._add_term(sums, adding)
        added += 1
    if not added:
      self.stats["zero_weight"] += 1
    elif added < len(self.sums):
      self.stats["term_zero_in_micro_batch"] += 1
    return True

  def _dropped(self, mb: MicroBatch, weights: list[list[float]]) -> bool:
    """Whether a counted micro-batch is dropped as a unit: a bad weight in any
    term on any replica, or (``"skip_micro_batch"``) a non-finite gradient or
    loss in a term with positive weight."""
    cfg = self.config
    bad = [not (math.isfinite(w) and w >= 0) for ws in weights for w in ws]
    if any(bad):
      if not all(bad) and cfg.terms is not None:
        self.stats["term_bad_weight"] += 1
      if cfg.grad_reduction == "window_mean":  # The window's shares are lost.
        self.stats["window_mean_drop"] += 1
        (sums,) = self.sums
        sums.bad = {n: np.ones(self.shapes[n], bool) for n in self.names}
        sums.acc = {n: np.full(self.shapes[n], np.nan) for n in self.names}
      return True
    if cfg.on_nonfinite != "skip_micro_batch":
      return False
    for r, ws in zip(mb.replicas, weights, strict=True):
      for t, w in zip(r.terms, ws, strict=True):
        finite = all(np.isfinite(g).all() for g in t.grads.values())
        if w > 0 and not (finite and (not cfg.pass_loss or math.isfinite(t.loss))):
          return True
    return False

  def _add_term(self, sums: TermSums, adding: list[tuple[Term, float]]) -> None:
    """Adds one term of the replicas with positive weight to its sums."""
    cfg = self.config
    mean = cfg.grad_reduction == "mean"
    for name in self.names:
      products = [t.grads[name] * (w if mean else 1.0) for t, w in adding]
      self._add_leaf(sums, name, products)
    sums.adds += 1
    sums.weight += sum(w for _, w in adding)
    if overflows(sums.weight, max_of(self.wd), self._band(self.wd, sums.adds)):
      raise Ambiguous("the window's weight overflows")  # Not drawn.
    if cfg.pass_loss:
      with np.errstate(invalid="ignore", over="ignore"):
        losses = [t.loss * (w if mean else 1.0) for t, w in adding]
        sums.loss += sum(losses)
      sums.loss_abs += sum(abs(x) for x in losses)
      band = self._band(self.wd, sums.adds)
      if not math.isfinite(sums.loss) or overflows(
        abs(sums.loss) + sums.loss_abs, max_of(self.wd), band
      ):
        sums.bad_loss = True

  def _add_leaf(self, sums: TermSums, name: str, products: list[np.ndarray]) -> None:
    """Adds the replicas' products of one leaf: where a product, their sum over
    replicas or the running sum overflows, the sum is not finite."""
    cfg = self.config
    pd = wider(cfg.acc_dtype(name), self.wd)  # the products' dtype
    with np.errstate(invalid="ignore", over="ignore"):
      magnitude = sum(np.abs(t) for t in products)
      new = sums.acc[name] + sum(products)
    bad = np.array(sums.bad[name] | ~np.isfinite(new))
    band = self._band(cfg.acc_dtype(name), sums.adds)
    for i in np.ndindex(new.shape):
      if bad[i]:
        continue
      sizes = [
        (max(abs(t[i]) for t in products), max_of(pd)),
        (abs(sums.acc[name][i]) + magnitude[i], max_of(pd)),
        (abs(new[i]), max_of(cfg.acc_dtype(name))),
      ]
      bad[i] = any(overflows(v, limit, band) for v, limit in sizes)
    sums.acc[name] = np.where(bad, np.nan, new)
    sums.acc_abs[name] = sums.acc_abs[name] + np.where(bad, 0.0, magnitude)
    sums.bad[name] = bad

  def _term_loss(self, sums: TermSums) -> tuple[float, float]:
    """A term's loss so far: its weighted mean (0 without weight)."""
    if sums.weight <= 0:
      return 0.0, 0.0
    if sums.bad_loss:
      return math.nan, 0.0
    shares = self.config.grad_reduction == "window_mean"
    scale = 1.0 if shares else sums.weight
    value = sums.loss / scale
    e = eps(self.wd) * (sums.adds + 3)
    return value, e * (sums.loss_abs / scale + abs(value))

  def _window_loss(self) -> tuple[float, float]:
    """The objective so far: the sum of the terms' weighted means."""
    parts = [self._term_loss(s) for s in self.sums]
    value, tol = sum(v for v, _ in parts), sum(t for _, t in parts)
    return value, tol + eps(self.wd) * (len(parts) - 1) * sum(abs(v) for v, _ in parts)

  def _gradient(self) -> tuple[dict, dict, bool]:
    """The window's gradient ``sum_t A_t / W_t`` over the terms with weight, its
    tolerance, and whether it overflows the leaf dtype (each term's mean
    gradient, and their running sum, in the dtype the inner optimizer gets)."""
    cfg = self.config
    divides = cfg.use_grad_mean and cfg.grad_reduction != "window_mean"
    weighted = [s for s in self.sums if s.weight > 0]
    grads, tols, nonfinite = {}, {}, False
    for name in self.names:
      leaf, ad = cfg.leaf_dtype(name), cfg.acc_dtype(name)
      total, tol = np.zeros(self.shapes[name]), np.zeros(self.shapes[name])
      magnitude = np.zeros(self.shapes[name])
      for s in weighted:
        scale = s.weight if divides else 1.0
        g = s.acc[name] / scale
        band = self._band(ad, s.adds)
        # Accumulation rounding, the weight's rounding, the product and the cast.
        rounding = (s.adds + 2) * (eps(ad) * s.acc_abs[name] + ulp0(ad))
        tol = tol + rounding / scale + ulp0(leaf)
        tol = tol + np.abs(g) * ((s.adds + 2) * eps(self.wd) + eps(leaf))
        total, magnitude = total + g, magnitude + np.abs(g)
        for i in np.ndindex(g.shape):
          nonfinite |= overflows(abs(g[i]), max_of(leaf), band)
          nonfinite |= overflows(abs(total[i]), max_of(leaf), band)
      # The terms' means are added in the leaf dtype.
      tol = tol + (len(weighted) - 1) * (eps(leaf) * magnitude + ulp0(leaf))
      grads[name], tols[name] = total, tol
    return grads, tols, nonfinite

  def _close(self) -> tuple[dict | None, float, float]:
    """Ends the window: (update, grad_norm, its tolerance)."""
    positive = any(s.weight > 0 for s in self.sums)
    nonfinite = positive and any(
      s.bad_loss or any(b.any() for b in s.bad.values()) for s in self.sums
    )
    if positive and not nonfinite:
      grads, tols, nonfinite = self._gradient()
    applies = positive and not nonfinite
    self.stats[
      "applied" if applies else "skipped_window" if positive else "empty_window"
    ] += 1
    self.updated = applies
    if not applies:
      if positive:
        self.skipped_w = self._inc(self.skipped_w)
      return None, 0.0, 0.0
    if any(s.weight <= 0 for s in self.sums):
      self.stats["term_without_weight"] += 1
      if self.sums[0].weight <= 0:
        self.stats["first_term_without_weight"] += 1
    # Schedules count the first term's items; the inner optimizer gets its weight.
    first = self.sums[0].weight
    if self.config.unit == "updates":
      progress = float(self.gstep)
    else:  # Whole nominal updates are counted exactly up to 2**61, then saturate.
      progress = min(self.items / self.config.per_update, 2.0**61)
    self.lr = float(schedule(progress))
    self.gstep = self._inc(self.gstep)
    self.items += first
    self.calls += 1
    self.window_weight = first
    self.window_micro = self.mini
    return self._update(grads, tols)

  def _update(self, grads: dict, tols: dict) -> tuple[dict, float, float]:
    """SGD's update of the window gradient, and the gradient's norm."""
    lr_tol = 4e-7 * self.lr
    update = {}
    for name in self.names:
      u = -self.lr * grads[name]
      leaf = self.config.leaf_dtype(name)
      tol = self.lr * tols[name] + np.abs(u) * (lr_tol / self.lr + eps(leaf))
      update[name] = (u, tol + ulp0(leaf))
    # The norm's squares are summed in the weight's dtype: they overflow
    # (the metric reads inf) or underflow (count as 0) at its limits.
    squares = sum(float(np.sum(g**2)) for g in grads.values())
    adds = max(s.adds for s in self.sums)
    if overflows(squares, max_of(self.wd), self._band(self.wd, adds)):
      return update, math.inf, 0.0
    norm = math.sqrt(squares)
    norm_tol = math.sqrt(sum(float(np.sum(t**2)) for t in tols.values()))
    size = sum(g.size for g in grads.values())
    # The metric is float32.
    norm_tol += 8 * eps(np.float32) * norm + math.sqrt(size * tiny(self.wd))
    if overflows(norm, max_of(np.float32), 1.01):
      norm = math.inf
    return update, norm, norm_tol

  # -- calls -------------------------------------------------------------------

  def _term_floats(self, sums: TermSums, ends: bool) -> dict[str, tuple]:
    """A term's metrics (its window so far) and the state's sums after the call."""
    weight = (sums.weight, eps(self.wd) * (sums.adds + 1) * sums.weight)
    acc_loss = (
      math.nan if sums.bad_loss else sums.loss,
      eps(self.wd) * (sums.adds + 2) * sums.loss_abs,
    )
    return {
      "loss": self._term_loss(sums),
      "weight": weight,
      "acc_weight": (0.0, 0.0) if ends else weight,
      "acc_loss": (0.0, 0.0) if ends else acc_loss,
    }

  def _acc(self) -> list[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Each term's window sum, with its tolerance and where it is not finite."""
    out = []
    for sums in self.sums:
      acc = {}
      for name in self.names:
        ad = self.config.acc_dtype(name)
        tol = (sums.adds + 2) * (eps(ad) * sums.acc_abs[name] + ulp0(ad))
        acc[name] = (sums.acc[name], tol, sums.bad[name])
      out.append(acc)
    return out

  def call(self, micro_batches: list[MicroBatch], scan: bool) -> Expected:
    """One call: a streamed micro-batch, or a scan-mode window of several."""
    keys, ends, counted = [], False, False
    for mb in micro_batches:
      keys.append(self.seen)
      counted = self._add(mb)
      if not scan:
        ends = (counted and self.mini >= self.config.k_at(self.gstep)) or mb.end_window
    ends = ends or scan
    terms = [self._term_floats(s, ends) for s in self.sums]
    metrics = {"loss": self._window_loss(), "weight": terms[0]["weight"]}
    micro_steps = self.mini
    acc = None
    if not ends:
      self.updated = False
      update, norm, norm_tol = None, 0.0, 0.0
      if self.mini > 0:
        acc = self._acc()
    else:
      update, norm, norm_tol = self._close()
      self.mini = 0
      self._empty_window()
    counters = {
      "mini_step": self.mini,
      "gradient_step": self.gstep,
      "updated": int(self.updated),
      "skipped_micro_batches": self.skipped_mb,
      "skipped_windows": self.skipped_w,
      "micro_batches_seen": self.seen,
      "skip_step": self.skip_step,
      "inner_calls": self.calls,
      "window_micro_steps": self.window_micro,
      "progress_updates": self.gstep,
      "micro_steps": micro_steps,
    }
    floats = {
      **metrics,
      "grad_norm": (norm, norm_tol),
      "learning_rate": (self.lr, 4e-7 * self.lr),
      "window_weight": (self.window_weight, 1e-6 * self.window_weight),
    }
    return Expected(counters, floats, terms, acc, update, keys)


# -- drawing examples -------------------------------------------------------------

#: The names of loss terms.
TERM_NAMES = ("ce", "kl", "aux")


def _draw_terms(rng: np.random.Generator) -> tuple[tuple[str, ...], tuple]:
  """2 or 3 terms (3 in a third of the examples: each costs a backward pass) in
  a random order, and each one's constant weight: ``None`` (drawn per
  micro-batch), 1 (a term counted once per call, like a router loss) or 0 for
  at most one term (it never has weight)."""
  count = 3 if rng.random() < 1 / 3 else 2
  names = tuple(str(n) for n in rng.permutation(TERM_NAMES)[:count])
  constants: list[float | None] = []
  for _ in names:
    u = rng.random()
    silent = u < 0.15 and 0.0 not in constants
    constants.append(0.0 if silent else 1.0 if u > 0.8 else None)
  return names, tuple(constants)


def draw_config(
  rng: np.random.Generator, *, replicas: int, train_step: bool, terms: bool = False
) -> Config:
  """A configuration; with loss terms if ``terms``."""
  names, constants = _draw_terms(rng) if terms else (None, None)
  x64 = bool(rng.random() < 0.15)
  dtypes = ["float32", "bfloat16", "float16"] + (["float64"] if x64 else [])
  shapes = [(), (3,), (2, 2)]
  leaves = tuple(
    (f"p{i}", shapes[rng.integers(len(shapes))], dtypes[rng.integers(len(dtypes))])
    for i in range(int(rng.integers(1, 4)))
  )
  if rng.random() < 0.7:
    every_k: int | tuple[int, int] = int(rng.integers(1, 5))
  else:
    every_k = (int(rng.integers(0, 4)), int(rng.integers(0, 4)))
  reduction = "mean"  # Loss terms need it.
  if names is None:
    reduction = str(rng.choice(["mean", "sum", "window_mean"], p=[0.4, 0.35, 0.25]))
  acc_choices = [None, None, None, "float32", "bfloat16", "float16"]
  accumulator = acc_choices[rng.integers(len(acc_choices))]
  if x64 and rng.random() < 0.3:
    accumulator = "float64"
  unit = str(rng.choice(["updates", "weight"]))
  pass_weight = (
    names is not None or train_step or reduction == "sum" or bool(rng.random() < 0.8)
  )
  if constants is None:
    constant = None
    if not pass_weight:
      constant = 1.0
    elif rng.random() < 0.2:
      constant = float(rng.choice([1.0, 5.0, 48.0]))
    constants = (constant,)
  any_constant = any(c is not None for c in constants)
  return Config(
    leaves=leaves,
    every_k=every_k,
    use_grad_mean=names is not None or bool(rng.random() < 0.75),
    grad_reduction=reduction,
    on_nonfinite="skip_window"
    if reduction == "window_mean"
    else str(rng.choice(["skip_window", "skip_micro_batch"])),
    skip_fn=bool(rng.random() < 0.3),
    accumulator_dtype=accumulator,
    unit=unit,
    per_update=float(rng.choice([10.0, 64.0])) if unit == "weight" else None,
    pass_weight=pass_weight,
    constant_weights=constants,
    literal_weight=train_step and any_constant and bool(rng.random() < 0.5),
    pass_loss=train_step or bool(rng.random() < 0.6),
    rng=[None, "typed", "raw"][rng.integers(3)] if train_step else None,
    replicas=replicas,
    x64=x64,
    terms=names,
  )


def _draw_weight(
  rng: np.random.Generator, constant: float | None, zeros: float
) -> float:
  """A weight: ``constant``, or drawn (0 with probability ``zeros`` at least)."""
  if constant is not None:
    return constant
  if zeros and rng.random() < zeros:
    return 0.0
  u = rng.random()
  if u < 0.50:
    w = float(rng.integers(1, 65))
  elif u < 0.62:
    w = 0.0
  elif u < 0.70:
    w = float(rng.uniform(0.5, 10.0))
  elif u < 0.76:
    w = -float(rng.integers(1, 10))
  elif u < 0.80:
    w = math.nan
  elif u < 0.84:
    w = float(rng.choice([math.inf, -math.inf]))
  else:
    w = float(rng.choice([257.0, 1000.0, 7e4, 3e5, 1e8, 1e30]))
  return float(np.float32(w))


def _draw_grads(
  rng: np.random.Generator, config: Config, mark: float | None, nonfinite: float
) -> dict:
  """One term's gradient; with probability ``nonfinite`` one entry is not
  finite; its first element ``mark`` where given (see ``draw_stream``)."""
  scale = float(rng.choice([1.0] * 12 + [1e-3, 3.0, 30.0, 1e3, 3e4, 1e20]))
  grads = {}
  for name, shape, dtype in config.leaves:
    g = rng.normal(size=shape) * min(scale, max_of(DTYPES[dtype]) / 100)
    g = np.asarray(g, DTYPES[dtype]).astype(np.float64)
    grads[name] = g
  if rng.random() < nonfinite:
    name = config.leaves[rng.integers(len(config.leaves))][0]
    flat = grads[name].reshape(-1)
    flat[rng.integers(flat.size)] = rng.choice([math.nan, math.inf, -math.inf])
  # The test's should_skip_update_fn reads the first element (every term's).
  first = grads[config.leaves[0][0]].reshape(-1)
  if mark is not None:
    first[0] = mark
  elif first[0] == SENTINEL:
    first[0] = -SENTINEL
  return grads


def _draw_replica(
  rng: np.random.Generator, config: Config, skip: bool, first: bool
) -> Replica:
  """One replica's terms: now and then a non-finite loss or gradient (in one
  of them: as often per replica with terms as without)."""
  share = 1 / config.term_count
  zeros = 0.25 if config.terms is not None else 0.0  # Terms often lack items.
  terms = []
  for constant in config.constant_weights:
    loss = float(np.float32(rng.normal() * 2))
    if rng.random() < 0.06 * share:
      loss = float(rng.choice([math.nan, math.inf]))
    # A flagged micro-batch's whole gradient starts with the sentinel: every
    # replica's under a weighted mean, the first replica's (others 0) under a sum.
    mean = config.grad_reduction == "mean"
    mark = (SENTINEL if mean or first else 0.0) if skip else None
    grads = _draw_grads(rng, config, mark, 0.08 * share)
    terms.append(Term(grads, _draw_weight(rng, constant, zeros), loss))
  return Replica(terms, skip)


def draw_stream(
  rng: np.random.Generator, config: Config, length: int, *, end_window: bool = True
) -> list[MicroBatch]:
  """``length`` micro-batches with weights, gradients, losses and flags."""
  stream = []
  for _ in range(length):
    skip = config.skip_fn and bool(rng.random() < 0.12)
    replicas = [
      _draw_replica(rng, config, skip, first=i == 0) for i in range(config.replicas)
    ]
    stream.append(MicroBatch(replicas, end_window and bool(rng.random() < 0.15)))
  return stream


def draw_chunks(rng: np.random.Generator, length: int) -> list[int]:
  """Sizes (1 to 3) of consecutive scan-mode windows covering ``length``."""
  sizes = []
  while length > 0:
    sizes.append(min(length, int(rng.integers(1, 4))))
    length -= sizes[-1]
  return sizes


# -- a loss that couples the window (docs/coupled.md) --------------------------------


def coupled_window_gradient(
  params: dict[str, np.ndarray], batch: dict[str, np.ndarray], scale: float
) -> dict[str, np.ndarray]:
  """The gradient a window of a :class:`optax_accum.CoupledLoss` applies, in
  float64, written from ``docs/coupled.md``: that of the window loss over all
  of the window's rows at once. The model: linear image and text towers
  ``A = X W_image``, ``B = Y W_text``; the loss: symmetric InfoNCE over the
  valid pairs, ``logits = scale * A B^T``, padding pairs neither anchors nor
  negatives, the mean over the ``n`` valid pairs of the two directions' mean.

  With ``G = dL/dlogits``: ``G = (R (P - I) + C (Q - I)) / (2 n)``, where
  ``P`` is the softmax of each valid row over the valid columns, ``Q`` of
  each valid column over the valid rows, and ``R``, ``C`` keep the valid
  rows, columns; then ``dW_image = scale X^T G B``, ``dW_text = scale Y^T
  G^T A``.
  """
  x = np.asarray(batch["image"], np.float64)
  y = np.asarray(batch["text"], np.float64)
  valid = np.asarray(batch["mask"], np.float64) > 0
  a = x @ np.asarray(params["image"], np.float64)
  b = y @ np.asarray(params["text"], np.float64)
  logits = scale * a @ b.T
  both = valid[:, None] & valid[None, :]
  n = valid.sum()

  def softmax(z: np.ndarray, axis: int) -> np.ndarray:
    z = np.where(both, z, -np.inf)
    top = np.max(np.where(both, z, -np.inf), axis=axis, keepdims=True)
    e = np.where(both, np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(axis=axis, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)

  eye = np.diag(valid.astype(np.float64))
  grad = (softmax(logits, 1) - eye + softmax(logits, 0) - eye) / (2 * n)
  grad = np.where(both, grad, 0.0)
  return {"image": scale * x.T @ grad @ b, "text": scale * y.T @ grad.T @ a}
