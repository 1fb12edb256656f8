"""Benchmarking optimizers with Cockpit: DeepOBS test problems (``problems``), runner, sweeps
and analysis."""
