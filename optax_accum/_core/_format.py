"""Formatting for the reports users print: ``AuditReport``, ``MicroBatchPlan``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def row(title: str, value: Any) -> str:
  """One ``title  value`` line of a report, titles aligned.

  Examples:
    >>> row("peak", "1.00 MiB")
    '  peak                       1.00 MiB'
  """
  return f"  {title:<26} {value}"


def table(rows: Sequence[Sequence[str]], marks: Sequence[str] = ()) -> list[str]:
  """Lines of a table with right-aligned columns, each followed by its mark.

  Examples:
    >>> print("\\n".join(table([["k", "peak"], ["4", "1 KiB"]], ["", " <- chosen"])))
      k   peak
      4  1 KiB <- chosen
  """
  marks = list(marks) or [""] * len(rows)
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return [
    "  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + mark
    for r, mark in zip(rows, marks, strict=True)
  ]


def size(n: int) -> str:
  """Bytes for people.

  Examples:
    >>> size(512), size(12_600), size(3 * 2**30)
    ('512 B', '12.3 KiB', '3.00 GiB')
  """
  value = float(n)
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(value) < 1024 or unit == "GiB":
      break
    value /= 1024
  return f"{n} B" if unit == "B" else f"{value:.{2 if value < 10 else 1}f} {unit}"


def short(values: Sequence[float]) -> str:
  """Numbers to three significant digits, in brackets.

  Examples:
    >>> short([0.001234, 2.0])
    '[0.00123, 2]'
  """
  return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def marks(flags: Sequence[bool]) -> str:
  """``U`` where a flag is set (an update), ``.`` elsewhere.

  Examples:
    >>> marks([False, True])
    '.U'
  """
  return "".join("U" if flag else "." for flag in flags)
