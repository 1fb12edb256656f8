"""``benchmarks/op_count.py``: the aten ops of a tracked step and each function's share."""

from __future__ import annotations

import re

from tests.benchmark.bench_helpers import run_benchmark


def test_op_count_lists_the_ops_of_a_tracked_step_by_function():
    out = run_benchmark("op_count.py", "--batch", "4", "--top", "50").stdout
    head, ops, made, calls, *rows = out.strip().splitlines()
    assert ops.startswith("ops: ")
    by_cockpit, by_user = map(int, re.search(
        r"tensors made: (\d+) by Cockpit's ops, (\d+) by the user's step", made).groups())
    assert by_cockpit > 0 and by_user > 0
    by_kind = dict(re.findall(r"(builtins|cockpit|other Python) (\d+)", calls))
    assert int(by_kind["cockpit"]) > 0 and int(by_kind["builtins"]) > 0
    assert int(re.search(r"Python calls in a tracked step: (\d+)", calls).group(1)) == sum(
        map(int, by_kind.values()))
    tracked, plain = map(int, re.search(r"(\d+) aten ops .*, (\d+) without", head).groups())
    assert tracked > plain > 0
    shares = {line.split(maxsplit=1)[1]: int(line.split()[0]) for line in rows}
    assert sum(shares.values()) <= tracked
    assert shares["the user's loop"] >= plain  # the user's loop: the same step's own ops, at least
    assert any(name.startswith("engine/histograms/") for name in shares)


def test_op_count_of_the_step_after_a_tracked_one_has_only_its_projections():
    """``--after``: the step where Alpha observes θ_{t+1} projects each layer's individual
    gradients on s_t and forms no histogram or norm: fewer ops than the tracked step."""
    outputs = {}
    for flags in ([], ["--after"]):
        out = run_benchmark("op_count.py", "--batch", "4", "--top", "50", *flags).stdout
        outputs[bool(flags)] = out.strip().splitlines()
    head, _, _, calls, *rows = outputs[True]
    assert "in the step after a tracked one" in head and "after a tracked one:" in calls
    after, plain = map(int, re.search(r"(\d+) aten ops .*, (\d+) without", head).groups())
    tracked = int(re.search(r"(\d+) aten ops", outputs[False][0]).group(1))
    assert plain < after < tracked
    shares = {line.split(maxsplit=1)[1]: int(line.split()[0]) for line in rows}
    assert any(name.endswith(":dots_many") for name in shares)  # the projections on s_t
    assert not any(name.startswith("engine/histograms/") for name in shares)
