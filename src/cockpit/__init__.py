"""Cockpit: a visual and statistical debugger for training deep neural networks."""

from cockpit import quantities, schedules
from cockpit._version import __version__
from cockpit.cockpit import Cockpit
from cockpit.configurations import configuration
from cockpit.diagnose import Finding, diagnose
from cockpit.engine.histograms.exact import BinSpec
from cockpit.schedules import at, every, logspaced

__all__ = [
    "BinSpec",
    "Cockpit",
    "Finding",
    "__version__",
    "at",
    "configuration",
    "diagnose",
    "every",
    "logspaced",
    "quantities",
    "schedules",
]
