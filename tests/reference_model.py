"""The documented accumulation semantics as a plain float64 NumPy model.

The oracle of ``tests/test_reference.py``. It is written from the README ("What
happens when...", "The ready-made train step") and the ``MultiSteps``
docstring, not from the library's code:

- A micro-batch is one entry per data-parallel replica (one entry without
  ``axis_name``). It is *counted* towards ``k`` unless ``should_skip_update_fn``
  rejects it on any replica; a rejected micro-batch is as if it never happened.
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
  constant_weight: float | None  # every micro-batch's weight, if they are equal
  literal_weight: bool  # train steps: loss_fn returns the constant as a Python float
  pass_loss: bool  # MultiSteps.update paths; train steps always pass the loss
  rng: str | None  # None, "typed" (jax.random.key) or "raw" (jax.random.PRNGKey)
  replicas: int
  x64: bool

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
class Replica:
  """What one replica passes for one micro-batch (values exact in their dtype)."""

  grads: dict[str, np.ndarray]  # float64 arrays holding leaf-dtype values
  weight: float
  loss: float
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
  # Window sum after the call (None while it counts as empty): value, tolerance
  # and where it must be non-finite.
  acc: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None
  # The inner optimizer's update (None: exact zeros): value and tolerance.
  update: dict[str, tuple[np.ndarray, np.ndarray]] | None
  keys: list[int]  # micro_batches_seen before each micro-batch of the call


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
    self.stats = dict.fromkeys(
      [
        "applied",
        "skipped_window",
        "empty_window",
        "dropped",
        "window_mean_drop",
        "rejected",
        "zero_weight",
      ],
      0,
    )
    self._empty_window()

  # -- window state ----------------------------------------------------------

  def _empty_window(self) -> None:
    self.acc = {n: np.zeros(self.shapes[n]) for n in self.names}
    self.acc_abs = {n: np.zeros(self.shapes[n]) for n in self.names}
    self.bad = {n: np.zeros(self.shapes[n], bool) for n in self.names}
    self.adds = 0
    self.acc_w = self.acc_w_abs = 0.0
    self.acc_l = self.acc_l_abs = 0.0
    self.bad_l = False

  def _band(self, dtype: np.dtype) -> float:
    return 1.02 + 4 * (self.adds + 2) * eps(dtype)

  @staticmethod
  def _inc(x: int) -> int:
    return min(x + 1, INT32_MAX)

  def _add(self, mb: MicroBatch) -> bool:
    """Adds one micro-batch; returns whether it counts towards k."""
    cfg = self.config
    self.seen = self._inc(self.seen)
    self.skip_step = self.gstep
    counted = not any(r.skip for r in mb.replicas)
    if not counted:
      self.stats["rejected"] += 1
      return False
    self.mini = self._inc(self.mini)
    weights = [float(np.asarray(r.weight, self.wd)) for r in mb.replicas]
    if not all(math.isfinite(w) and w >= 0 for w in weights):
      self.skipped_mb = self._inc(self.skipped_mb)
      if cfg.grad_reduction == "window_mean":  # The window's shares are lost.
        self.stats["window_mean_drop"] += 1
        self.bad = {n: np.ones(self.shapes[n], bool) for n in self.names}
        self.acc = {n: np.full(self.shapes[n], np.nan) for n in self.names}
      self.stats["dropped"] += 1
      return True
    adding = [(r, w) for r, w in zip(mb.replicas, weights, strict=True) if w > 0]
    if cfg.on_nonfinite == "skip_micro_batch":
      for r, _ in adding:
        finite = all(np.isfinite(g).all() for g in r.grads.values())
        if not (finite and (not cfg.pass_loss or math.isfinite(r.loss))):
          self.skipped_mb = self._inc(self.skipped_mb)
          self.stats["dropped"] += 1
          return True
    if not adding:
      self.stats["zero_weight"] += 1
      return True
    mean = cfg.grad_reduction == "mean"
    for name in self.names:
      pd = wider(cfg.acc_dtype(name), self.wd)  # the products' dtype
      terms = [r.grads[name] * (w if mean else 1.0) for r, w in adding]
      with np.errstate(invalid="ignore", over="ignore"):
        magnitude = sum(np.abs(t) for t in terms)
        new = self.acc[name] + sum(terms)
      bad = np.array(self.bad[name] | ~np.isfinite(new))
      band = self._band(cfg.acc_dtype(name))
      for i in np.ndindex(new.shape):
        if bad[i]:
          continue
        # A product, the sum over replicas or the running sum can overflow.
        sizes = [
          (max(abs(t[i]) for t in terms), max_of(pd)),
          (abs(self.acc[name][i]) + magnitude[i], max_of(pd)),
          (abs(new[i]), max_of(cfg.acc_dtype(name))),
        ]
        bad[i] = any(overflows(v, limit, band) for v, limit in sizes)
      self.acc[name] = np.where(bad, np.nan, new)
      self.acc_abs[name] = self.acc_abs[name] + np.where(bad, 0.0, magnitude)
      self.bad[name] = bad
    self.adds += 1
    total = sum(w for _, w in adding)
    self.acc_w += total
    self.acc_w_abs += total
    if overflows(self.acc_w, max_of(self.wd), self._band(self.wd)):
      raise Ambiguous("the window's weight overflows")  # Not drawn.
    if cfg.pass_loss:
      with np.errstate(invalid="ignore", over="ignore"):
        losses = [r.loss * (w if mean else 1.0) for r, w in adding]
        self.acc_l += sum(losses)
      self.acc_l_abs += sum(abs(x) for x in losses)
      if not math.isfinite(self.acc_l) or overflows(
        abs(self.acc_l) + self.acc_l_abs, max_of(self.wd), self._band(self.wd)
      ):
        self.bad_l = True
    return True

  def _window_loss(self) -> tuple[float, float]:
    if self.acc_w <= 0:
      return 0.0, 0.0
    if self.bad_l:
      return math.nan, 0.0
    shares = self.config.grad_reduction == "window_mean"
    scale = 1.0 if shares else self.acc_w
    value = self.acc_l / scale
    e = eps(self.wd) * (self.adds + 3)
    return value, e * (self.acc_l_abs / scale + abs(value))

  def _close(self) -> tuple[dict | None, float, float, bool]:
    """Ends the window: (update, grad_norm, its tolerance, applied)."""
    cfg = self.config
    positive = self.acc_w > 0
    nonfinite = False
    grads, tols = {}, {}
    if positive:
      divides = cfg.use_grad_mean and cfg.grad_reduction != "window_mean"
      scale = self.acc_w if divides else 1.0
      nonfinite = self.bad_l or any(b.any() for b in self.bad.values())
      squares = 0.0
      for name in self.names if not nonfinite else ():
        leaf = cfg.leaf_dtype(name)
        ad = cfg.acc_dtype(name)
        g = self.acc[name] / scale
        band = self._band(ad)
        for i in np.ndindex(g.shape):
          nonfinite |= overflows(abs(g[i]), max_of(leaf), band)
        # Accumulation rounding, the weight's rounding, the product and the cast.
        rounding = (self.adds + 2) * (eps(ad) * self.acc_abs[name] + ulp0(ad))
        tol = rounding / scale + ulp0(leaf)
        tol = tol + np.abs(g) * ((self.adds + 2) * eps(self.wd) + eps(leaf))
        grads[name], tols[name] = g, tol
        squares += float(np.sum(g**2))
    applies = positive and not nonfinite
    self.stats[
      "applied" if applies else "skipped_window" if positive else "empty_window"
    ] += 1
    update, norm, norm_tol = None, 0.0, 0.0
    if applies:
      if cfg.unit == "updates":
        progress = float(self.gstep)
      else:  # Whole nominal updates are counted exactly up to 2**61, then saturate.
        progress = min(self.items / cfg.per_update, 2.0**61)
      self.lr = float(schedule(progress))
      lr_tol = 4e-7 * self.lr
      update = {}
      for name in self.names:
        u = -self.lr * grads[name]
        leaf = cfg.leaf_dtype(name)
        tol = self.lr * tols[name] + np.abs(u) * (lr_tol / self.lr + eps(leaf))
        update[name] = (u, tol + ulp0(leaf))
      # The norm's squares are summed in the weight's dtype: they overflow
      # (the metric reads inf) or underflow (count as 0) at its limits.
      norm, norm_tol = math.sqrt(squares), 0.0
      if overflows(squares, max_of(self.wd), self._band(self.wd)):
        norm = math.inf
      else:
        norm_tol = math.sqrt(sum(float(np.sum(t**2)) for t in tols.values()))
        size = sum(g.size for g in grads.values())
        # The metric is float32.
        norm_tol += 8 * eps(np.float32) * norm + math.sqrt(size * tiny(self.wd))
        if overflows(norm, max_of(np.float32), 1.01):
          norm = math.inf
      self.gstep = self._inc(self.gstep)
      self.items += self.acc_w
      self.calls += 1
      self.window_weight = self.acc_w
      self.window_micro = self.mini
    elif positive:
      self.skipped_w = self._inc(self.skipped_w)
    self.updated = applies
    return update, norm, norm_tol, applies

  # -- calls -------------------------------------------------------------------

  def call(self, micro_batches: list[MicroBatch], scan: bool) -> Expected:
    """One call: a streamed micro-batch, or a scan-mode window of several."""
    keys, ends, counted = [], False, False
    for mb in micro_batches:
      keys.append(self.seen)
      counted = self._add(mb)
      if not scan:
        ends = (counted and self.mini >= self.config.k_at(self.gstep)) or mb.end_window
    ends = ends or scan
    loss, loss_tol = self._window_loss()
    metrics = {
      "loss": (loss, loss_tol),
      "weight": (self.acc_w, eps(self.wd) * (self.adds + 1) * self.acc_w_abs),
    }
    micro_steps = self.mini
    acc = None
    if not ends:
      self.updated = False
      update, norm, norm_tol = None, 0.0, 0.0
      if self.mini > 0:
        acc = {}
        for name in self.names:
          ad = self.config.acc_dtype(name)
          tol = (self.adds + 2) * (eps(ad) * self.acc_abs[name] + ulp0(ad))
          acc[name] = (self.acc[name], tol, self.bad[name])
    else:
      update, norm, norm_tol, _ = self._close()
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
    acc_loss = (
      math.nan if self.bad_l else self.acc_l,
      eps(self.wd) * (self.adds + 2) * self.acc_l_abs,
    )
    floats = {
      **metrics,
      "grad_norm": (norm, norm_tol),
      "learning_rate": (self.lr, 4e-7 * self.lr),
      "window_weight": (self.window_weight, 1e-6 * self.window_weight),
      "acc_weight": (0.0, 0.0) if ends else metrics["weight"],
      "acc_loss": (0.0, 0.0) if ends else acc_loss,
    }
    return Expected(counters, floats, acc, update, keys)


# -- drawing examples -------------------------------------------------------------


def draw_config(rng: np.random.Generator, *, replicas: int, train_step: bool) -> Config:
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
  reduction = str(rng.choice(["mean", "sum", "window_mean"], p=[0.4, 0.35, 0.25]))
  acc_choices = [None, None, None, "float32", "bfloat16", "float16"]
  accumulator = acc_choices[rng.integers(len(acc_choices))]
  if x64 and rng.random() < 0.3:
    accumulator = "float64"
  unit = str(rng.choice(["updates", "weight"]))
  pass_weight = train_step or reduction == "sum" or bool(rng.random() < 0.8)
  constant = None
  if not pass_weight:
    constant = 1.0
  elif rng.random() < 0.2:
    constant = float(rng.choice([1.0, 5.0, 48.0]))
  return Config(
    leaves=leaves,
    every_k=every_k,
    use_grad_mean=bool(rng.random() < 0.75),
    grad_reduction=reduction,
    on_nonfinite="skip_window"
    if reduction == "window_mean"
    else str(rng.choice(["skip_window", "skip_micro_batch"])),
    skip_fn=bool(rng.random() < 0.3),
    accumulator_dtype=accumulator,
    unit=unit,
    per_update=float(rng.choice([10.0, 64.0])) if unit == "weight" else None,
    pass_weight=pass_weight,
    constant_weight=constant,
    literal_weight=train_step and constant is not None and bool(rng.random() < 0.5),
    pass_loss=train_step or bool(rng.random() < 0.6),
    rng=[None, "typed", "raw"][rng.integers(3)] if train_step else None,
    replicas=replicas,
    x64=x64,
  )


def _draw_weight(rng: np.random.Generator, constant: float | None) -> float:
  if constant is not None:
    return constant
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


def _draw_grads(rng: np.random.Generator, config: Config, skip: bool) -> dict:
  scale = float(rng.choice([1.0] * 12 + [1e-3, 3.0, 30.0, 1e3, 3e4, 1e20]))
  grads = {}
  for name, shape, dtype in config.leaves:
    g = rng.normal(size=shape) * min(scale, max_of(DTYPES[dtype]) / 100)
    g = np.asarray(g, DTYPES[dtype]).astype(np.float64)
    grads[name] = g
  if rng.random() < 0.08:
    name = config.leaves[rng.integers(len(config.leaves))][0]
    flat = grads[name].reshape(-1)
    flat[rng.integers(flat.size)] = rng.choice([math.nan, math.inf, -math.inf])
  first = grads[config.leaves[0][0]].reshape(-1)
  if skip:
    first[0] = SENTINEL
  elif first[0] == SENTINEL:
    first[0] = -SENTINEL
  return grads


def draw_stream(
  rng: np.random.Generator, config: Config, length: int, *, end_window: bool = True
) -> list[MicroBatch]:
  """``length`` micro-batches with weights, gradients, losses and flags."""
  constant = config.constant_weight
  stream = []
  for _ in range(length):
    replicas = []
    for _ in range(config.replicas):
      skip = config.skip_fn and bool(rng.random() < 0.12)
      loss = float(np.float32(rng.normal() * 2))
      if rng.random() < 0.06:
        loss = float(rng.choice([math.nan, math.inf]))
      replicas.append(
        Replica(_draw_grads(rng, config, skip), _draw_weight(rng, constant), loss, skip)
      )
    stream.append(MicroBatch(replicas, end_window and bool(rng.random() < 0.15)))
  return stream


def draw_chunks(rng: np.random.Generator, length: int) -> list[int]:
  """Sizes (1 to 3) of consecutive scan-mode windows covering ``length``."""
  sizes = []
  while length > 0:
    sizes.append(min(length, int(rng.integers(1, 4))))
    length -= sizes[-1]
  return sizes
