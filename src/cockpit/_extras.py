"""The name Cockpit is installed under, and the error for an optional dependency that is
missing: one line that names the extra to install."""

from __future__ import annotations

DISTRIBUTION = "torch-cockpit"  # `pip install torch-cockpit`; the import name is `cockpit`


def install_hint(extra: str) -> str:
    """The command that installs an optional part, e.g. ``pip install 'torch-cockpit[wandb]'``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing_extra(error: ImportError, package: str, extra: str, what: str) -> ImportError:
    """The error to raise for ``error``, caught while importing ``package`` for ``what``.

    Where ``package`` (or a module of it) is not installed, an ``ImportError`` of one line:
    ``<what> needs <package>, which is not installed: pip install 'torch-cockpit[<extra>]'``.
    A different missing module (``package`` is installed but one of its own dependencies
    is broken) is returned unchanged: the extra's name would not help there."""
    missing = error.name
    top = package.split(".")[0]
    if missing is not None and not (missing == top or missing.startswith(top + ".")):
        return error
    return ImportError(f"{what} needs {package}, which is not installed: {install_hint(extra)}",
                       name=package)
