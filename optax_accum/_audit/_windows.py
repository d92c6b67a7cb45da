"""Where a setup applies its updates, against where windows end: F4 and F7.

The places come from the probe run (the setup around its own optimizer with
the updates replaced by the gradient), so they do not depend on the learning
rate: a schedule that reaches 0 stops the params, not the loop's updates.
Without a probe (an accumulator inside the optimizer) they come from the
setup's own params.
"""

from __future__ import annotations

import dataclasses

from optax_accum._audit._report import FIXES, Verdict
from optax_accum._audit._runs import LoopRun, Reference
from optax_accum._core import _format


@dataclasses.dataclass(frozen=True)
class Windows:
  """Where the loop applies updates, and where it should.

  Attributes:
    k: Micro-batches per window.
    steps: Updates before the restart.
    applied: For each micro-step before the restart, whether the loop applied
      an update (the probe's params changed; without a probe, the setup's).
    applied_resumed: The same from the micro-step before the restart on.
    expected: Where windows end with an update that moves those params: where
      the whole-batch gradient is nonzero (without a probe: where the
      whole-batch params changed).
    expected_resumed: The same from the micro-step before the restart on.
    measured: Whether ``applied`` comes from the probe.
    changed: For each micro-step before the restart, whether the setup's own
      params changed.
    resumed: The same from the micro-step before the restart on.
  """

  k: int
  steps: int
  applied: list[bool]
  applied_resumed: list[bool]
  expected: list[bool]
  expected_resumed: list[bool]
  measured: bool
  changed: list[bool]
  resumed: list[bool]

  @property
  def aligned(self) -> bool:
    """Whether updates land where windows end after the restart too."""
    return self.applied_resumed == self.expected_resumed

  @property
  def shifted(self) -> bool:
    """Whether they land one micro-step late after the restart: a micro-step
    count kept outside the optimizer state, started again from 0."""
    late = [False, *self.expected_resumed[:-1]]
    return any(self.expected_resumed) and self.applied_resumed == late

  @property
  def compared(self) -> int:
    """Updates compared with the whole batch: the two after the restart too
    where their windows line up."""
    return self.steps + 2 if self.aligned else self.steps

  def zero_updates(self) -> tuple[list[int], int]:
    """Micro-steps (0-based, on through the restart) where the loop applied
    an update that left the setup's params as they were; and how many
    updates it applied."""
    applied = self.applied + self.applied_resumed
    moved = self.changed + self.resumed
    zero = [
      i for i, (a, m) in enumerate(zip(applied, moved, strict=True)) if a and not m
    ]
    return zero, sum(applied)


def _ends(updates: list[bool], k: int) -> list[bool]:
  """Per micro-step: whether a window ends there with an update."""
  return [flag for update in updates for flag in [False] * (k - 1) + [update]]


def per_micro_step(
  flags: list[bool], k: int, steps: int
) -> tuple[list[bool], list[bool]]:
  """``flags`` per update as per micro-step, before and from the restart on."""
  return _ends(flags[:steps], k), [*_ends(flags[steps : steps + 2], k), False]


def needs_probe(k: int, steps: int, reference: Reference, run: LoopRun) -> bool:
  """Whether the setup's params leave open where it applies updates: they do
  not change at exactly the window ends whose whole-batch gradient is nonzero."""
  return (run.changed, run.resumed) != per_micro_step(reference.moving, k, steps)


def windows(
  k: int, steps: int, reference: Reference, run: LoopRun, probe: LoopRun | None
) -> Windows:
  """The :class:`Windows` of a setup's run: from the probe's run where given
  (and finite), else from the setup's own params, which are exact where
  :func:`needs_probe` is false."""
  measured = not needs_probe(k, steps, reference, run)
  source = run
  if probe is not None and probe.nonfinite_at is None:
    measured, source = True, probe
  expected, resumed = per_micro_step(
    reference.moving if measured else reference.changed, k, steps
  )
  return Windows(
    k,
    steps,
    source.changed,
    source.resumed,
    expected,
    resumed,
    measured,
    run.changed,
    run.resumed,
  )


def window_verdicts(w: Windows, schedule_found: bool) -> tuple[Verdict, Verdict]:
  """F7 and F4. With ``schedule_found`` (F3) and no probe, params that stop
  at a window end may be the schedule's doing, which only F3 then claims."""
  if not any(w.expected + w.expected_resumed):
    why = (
      "the whole batch's gradient is 0"
      if w.measured
      else "the whole-batch run never changed the params"
    )
    return Verdict("n/a", why), Verdict("n/a", why)
  if not any(w.applied):
    return _never_applied(w, schedule_found), Verdict("n/a", "no update to place")
  return _after_restart(w, schedule_found), _placement(w, schedule_found)


def _never_applied(w: Windows, schedule_found: bool) -> Verdict:
  if w.measured:
    return Verdict(
      "FOUND",
      "params never changed: your loop applies none of the updates, even with "
      "the optimizer's updates replaced by the gradient",
      FIXES["F7"],
    )
  if not schedule_found:
    return Verdict("FOUND", "params never changed", FIXES["F7"])
  return Verdict(
    "n/a",
    "params never changed while a step count runs ahead (F3): a schedule past "
    "its end returns zero updates, which explains it; with the accumulator "
    "inside your optimizer the audit cannot tell it from F7",
  )


def _first_misplaced(
  applied: list[bool], expected: list[bool], k: int, lenient: bool
) -> int | None:
  """The first micro-step whose update is where no window ends, or missing
  where one does; ``lenient`` leaves missing ones at window ends out."""
  for i, (a, e) in enumerate(zip(applied, expected, strict=True)):
    if a != e and not (lenient and i % k == k - 1):
      return i
  return None


def _placement(w: Windows, schedule_found: bool) -> Verdict:
  """F4: updates where windows end, from a fresh start and after the restart."""
  k, lenient = w.k, schedule_found and not w.measured
  i = _first_misplaced(w.applied, w.expected, k, lenient)
  if i is not None:
    detail = (
      f"an update is applied after micro-step {i + 1}; windows end every {k}"
      if w.applied[i]
      else f"no update is applied after micro-step {i + 1}, where window "
      f"{i // k + 1} ends"
    )
    return Verdict("FOUND", detail, FIXES["F4"])
  after = w.applied_resumed[1:]
  misplaced = _first_misplaced(w.applied_resumed, w.expected_resumed, k, lenient)
  if w.shifted or not any(after) or misplaced is None:
    return Verdict("ok", "updates at window ends")
  return Verdict(
    "FOUND",
    f"after a restart one micro-step into a window, updates are applied at "
    f"{_format.marks(after)}, windows end at {_format.marks(w.expected_resumed[1:])}",
    FIXES["F4"],
  )


def _after_restart(w: Windows, schedule_found: bool) -> Verdict:
  """F7: updates go on after a restart one micro-step into a window."""
  after, first, last = w.applied_resumed[1:], w.steps + 1, w.steps + 2
  if not any(w.expected_resumed[1:]):
    return Verdict(
      "n/a",
      f"params changed; after the restart the whole batch does not move either "
      f"(updates {first}-{last}), so the restart tests nothing",
    )
  if not any(after):
    if not w.measured and schedule_found:
      return Verdict(
        "n/a",
        "params froze after a restart one micro-step into a window while a step "
        "count runs ahead (F3): a schedule past its end explains it; with the "
        "accumulator inside your optimizer the audit cannot tell it from F7",
      )
    return Verdict("FOUND", _frozen(w, len(after)), FIXES["F7"])
  detail = "updates applied, and again after a restart mid-window"
  if w.shifted:
    detail += " (one micro-step late there: a micro-step count outside the state)"
  zero, _ = w.zero_updates()
  if w.measured and zero and not any(w.changed + w.resumed):
    cause = "(F3)" if schedule_found else "(see other)"
    detail += f"; params never move: your optimizer returns zero updates {cause}"
  return Verdict("ok", detail)


def _frozen(w: Windows, n: int) -> str:
  how = (
    ", even with the optimizer's updates replaced by the gradient (what your "
    "loop keeps outside its state, such as a micro-step count,"
    if w.measured
    else " (the loop's own micro-step count"
  )
  return (
    f"params froze after a restart one micro-step into a window: no update in "
    f"the {n} micro-steps after it{how} no longer agrees with the optimizer "
    "state, as after a resumed run or a skipped batch)"
  )
