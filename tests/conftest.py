"""Fixtures shared by the test modules, and ``--accelerator-path``.

``pytest --accelerator-path`` runs the tests with the accelerator paths forced on the CPU
(device histograms, batched curvature, fused dot products, stacks and small parameters side
by side: what a GPU runs) and skips the tests marked ``cpu_path``, which assert the CPU
path's own behaviour (its kernels, bitwise replays, worker threads). Every other test checks
its values against the same references on both paths, so a failure there is a difference of
the accelerator path.
"""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--accelerator-path", action="store_true",
                     help="force the accelerator paths on the CPU; skip tests marked cpu_path")


def pytest_configure(config):
    if config.getoption("--accelerator-path"):
        from cockpit.engine.histograms import device

        device._forced = True


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--accelerator-path"):
        return
    skip = pytest.mark.skip(reason="asserts the CPU path (--accelerator-path)")
    for item in items:
        if "cpu_path" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny batches run faster on one thread (and do not fight other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
