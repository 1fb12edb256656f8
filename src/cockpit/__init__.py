"""Cockpit: a visual and statistical debugger for training deep neural networks."""

__version__ = "0.1.0"

from cockpit import quantities, schedules  # noqa: E402
from cockpit.cockpit import Cockpit  # noqa: E402
from cockpit.configurations import configuration  # noqa: E402
from cockpit.engine.histogram import BinSpec  # noqa: E402
from cockpit.schedules import at, every, logspaced  # noqa: E402

__all__ = [
    "BinSpec",
    "Cockpit",
    "__version__",
    "at",
    "configuration",
    "every",
    "logspaced",
    "quantities",
    "schedules",
]
