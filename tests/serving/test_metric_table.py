"""The server's metrics are declared once (`serving.metrics.Metric`): every metric the code reports is
a declared one, every declared one is reported somewhere, and `/metrics` lists each with its type and
help text, named as Prometheus names counters and gauges."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dwarfstar
from dwarfstar.serving.metrics import COUNTER, GAUGE, Metric

PACKAGE = Path(dwarfstar.__file__).parent
REPORTS = {"inc", "set", "raise_to"}  # the `Metrics` calls that write a series


def trees() -> dict[str, ast.Module]:
    return {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def test_every_reported_metric_is_declared_and_every_declared_one_reported():
    reports, members = {}, set()
    for name, tree in trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Metric":
                members.add(node.attr)
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in REPORTS and ast.unparse(node.func.value).endswith("metrics"):
                reports.setdefault(name, []).append(node.args[0])
    assert len(reports["serving/scheduler.py"]) > 20  # the scan sees the scheduler's reports
    # each names a member (`Metric.X`), or is a variable bound to one: never a string, never a name made up
    for first in (first for found in reports.values() for first in found):
        assert isinstance(first, ast.Attribute | ast.Name), ast.unparse(first)
    assert members == set(Metric.__members__)  # no name the code uses is undeclared, none declared is unused


def test_no_metric_name_is_written_out_in_the_code():
    names = [metric.key for metric in Metric]
    written = [
        (path.relative_to(PACKAGE).as_posix(), name)
        for path in PACKAGE.rglob("*.py")
        for name in names
        if f'"{name}"' in path.read_text()
    ]
    assert written == []


def test_metrics_endpoint_lists_each_declared_metric(http):
    text = http.get("/metrics").text
    helps = dict(re.findall(r"^# HELP (\S+) (.+)$", text, re.M))
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert helps == {metric.key: metric.help for metric in Metric}
    assert kinds == {metric.key: metric.kind for metric in Metric}
    for name, kind in kinds.items():
        assert re.fullmatch(r"dwarfstar_[a-z0-9_]+", name)
        # Prometheus: a counter's name ends in _total, a gauge's does not
        assert kind in (COUNTER, GAUGE) and name.endswith("_total") == (kind == COUNTER), name
        assert re.search(rf"^{name}(\{{.*\}})? \S+$", text, re.M), f"{name} has no sample"
