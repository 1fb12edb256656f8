"""Histograms of individual-gradient elements (paper eq. 15 and 16), exact at every bin edge.

* :mod:`.exact` — bins (:class:`~.exact.BinSpec`) and the 1-D kernels (dense, outer product
  without forming it);
* :mod:`.auto_range` — GradHist1d's default range, decided from the first tracked step;
* :mod:`.outer2d` — the 2-D histogram of (g_{n,j}, θ_j) for outer-product gradients;
* :mod:`.device` — counting on accelerators without contended atomic adds;
* :mod:`.rounding` — directed rounding on the CPU, which makes the bin index exact.
"""
