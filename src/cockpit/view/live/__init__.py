"""Live cockpit views: a figure redrawn in place (:class:`LivePlot`) and a small web
page served with the standard library only (:func:`serve`).

The web view reads the run log of another process (training writes it, the viewer only
reads), so it works during training, after a crash and for finished runs. Routes:

* ``/``              an HTML page: the cockpit view (``/view.png``) fitted to the window
                     (a button shows it at full size, the page then scrolls), and beside
                     it the diagnosis and a read-out of the values under the pointer; an
                     inline script polls ``/status.json`` and reloads what changed,
* ``/view.png``      the last finished drawing of the cockpit view (never waits for one),
* ``/status.json``   ``{"last_step", "num_steps", "run", "rendered", "rendering"}``; the
                     page sends the size of its figure area (``?w=…&h=…``, CSS pixels),
                     and the view is drawn at that size,
* ``/panels.json``   where each panel of ``/view.png`` is (fractions of the image) with its
                     x range and instruments, the recorded values of those instruments,
                     and the histogram shown, for the hover read-out,
* ``/findings.json`` :func:`cockpit.diagnose.diagnose` of the run log.

Nothing else is served (no files at all); every other path is a 404.

Drawing the view takes seconds on a busy CPU, longer than a poll. One renderer thread draws
it: at most once per new run-log state (a state that changed while drawing is drawn next,
the steps in between are skipped), never two drawings at once, and again when the page's
size changed. Requests never wait for it: ``/view.png`` and ``/panels.json`` give the last
finished drawing, ``/status.json`` reads only the run log's step count.

The modules: :mod:`~cockpit.view.live.plot` (:class:`LivePlot`),
:mod:`~cockpit.view.live.renderer` (the drawing and the renderer thread),
:mod:`~cockpit.view.live.readout` (panel positions and values for the read-out, the
findings), :mod:`~cockpit.view.live.page` (the HTML page) and
:mod:`~cockpit.view.live.server` (the HTTP routes, :func:`serve`).
"""

from cockpit.view.live.plot import LivePlot
from cockpit.view.live.readout import findings_data, hover_data, panel_readouts, readout_names
from cockpit.view.live.renderer import render_png
from cockpit.view.live.server import make_server, serve

__all__ = ["LivePlot", "findings_data", "hover_data", "make_server", "panel_readouts",
           "readout_names", "render_png", "serve"]
