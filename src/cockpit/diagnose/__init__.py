"""Diagnosis: turn recorded instruments into findings in plain words.

``diagnose(source)`` reads a finished or running run (a ``Cockpit``, a run-log directory or
``get_output()``'s dict) and returns :class:`Finding` objects whose ``code`` comes from a
fixed vocabulary (:data:`CODES`). It reads recorded values only, never the model. The
thresholds of every check live in :mod:`cockpit.diagnose.thresholds`, each with its reason.
"""

from cockpit.diagnose.diagnoser import Diagnoser, diagnose
from cockpit.diagnose.finding import CHECKS_SKIPPED, CODES, Evidence, Finding

__all__ = ["CHECKS_SKIPPED", "CODES", "Diagnoser", "Evidence", "Finding", "diagnose"]
