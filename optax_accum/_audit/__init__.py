"""``audit``: checks an accumulation setup against training on the whole batch."""

from optax_accum._audit._audit import audit
from optax_accum._audit._per_window import per_window
from optax_accum._audit._report import AuditReport, Verdict

__all__ = ("AuditReport", "Verdict", "audit", "per_window")
