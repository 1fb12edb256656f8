"""DeepOBS-style benchmarking with Cockpit attached: test problems
(:mod:`cockpit.benchmark.problems`), one run (:mod:`~cockpit.benchmark.runner`), tuning sweeps
in the Crowded Valley protocol (:mod:`~cockpit.benchmark.sweep`, executors in
:mod:`~cockpit.benchmark.executors`) and the analyzer (:mod:`~cockpit.benchmark.analyzer`).
A user of Cockpit, never used by it. Command line: ``cockpit bench run|sweep|analyze``."""
