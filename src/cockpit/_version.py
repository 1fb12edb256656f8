"""The installed version of Cockpit (``cockpit.__version__``), in a module of its own so
that the package's modules can read it without importing the package itself."""

import importlib.metadata as _metadata

from cockpit._extras import DISTRIBUTION as _DISTRIBUTION

try:
    __version__ = _metadata.version(_DISTRIBUTION)
except _metadata.PackageNotFoundError:  # a source tree on the path, not installed
    __version__ = "0+unknown"
