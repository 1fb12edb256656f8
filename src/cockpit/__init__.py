"""Cockpit: a visual and statistical debugger for training deep neural networks."""

import importlib.metadata as _metadata

from cockpit._extras import DISTRIBUTION as _DISTRIBUTION

try:
    __version__ = _metadata.version(_DISTRIBUTION)
except _metadata.PackageNotFoundError:  # a source tree on the path, not installed
    __version__ = "0+unknown"

from cockpit import quantities, schedules
from cockpit.cockpit import Cockpit
from cockpit.configurations import configuration
from cockpit.diagnose import Finding, diagnose
from cockpit.engine.histogram import BinSpec
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
