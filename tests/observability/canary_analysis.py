"""The canary analysis of the prod overlay, as Argo Rollouts runs it, against any Prometheus.

The metrics come from the rendered manifests (``kubectl kustomize deploy/k8s/overlays/prod``: the
AnalysisTemplate ``prediction-canary`` and the Rollout's ``analysis.args``), never from a copy:
:func:`analysis_metrics` resolves ``{{args.*}}`` as Argo does (a value from the Rollout, else the
template's default; the pod-template hashes are given, as Argo passes them). :func:`measure` runs
a metric's query and :func:`phase_of` judges its result as Argo Rollouts' ``EvaluateResult`` does:
``result`` is the list of the vector's values (empty when the query finds no series; NaN where it
divides nothing by nothing); with a successCondition only, anything but success is Failed; with a
failureCondition only, anything but failure is Successful; with both, neither holding is
Inconclusive; a condition that cannot be evaluated (``result[0]`` of an empty result) is Error.
:func:`run_phase` gives what the AnalysisRun becomes after one measurement of each metric, by
their ``failureLimit``, ``inconclusiveLimit`` and ``consecutiveErrorLimit``. Only the small part of
Argo's expression language the manifests use is accepted: comparisons, ``&&``, ``||``, ``!``,
``len()``, ``isNaN()``, ``isInf()``, indexing and numbers; anything else is refused rather than
guessed.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass

_ARG = re.compile(r"\{\{\s*args\.([\w-]+)\s*\}\}")


SUCCESSFUL, FAILED, INCONCLUSIVE, ERROR, RUNNING = "Successful", "Failed", "Inconclusive", "Error", "Running"
# analysisutil.IsWorse: the order in which a run's completed metrics decide its phase.
_WORSE = [SUCCESSFUL, INCONCLUSIVE, ERROR, FAILED]
_DEFAULT_CONSECUTIVE_ERROR_LIMIT = 4  # Argo's DefaultConsecutiveErrorLimit


@dataclass(frozen=True)
class Metric:
    """One analysis metric with every argument resolved."""

    name: str
    query: str
    success_condition: str | None
    failure_condition: str | None
    interval: str
    initial_delay: str | None = None
    failure_limit: int = 0
    inconclusive_limit: int = 0
    consecutive_error_limit: int = _DEFAULT_CONSECUTIVE_ERROR_LIMIT


@dataclass(frozen=True)
class Measurement:
    metric: str
    result: list[float]
    phase: str  # SUCCESSFUL, FAILED, INCONCLUSIVE or ERROR

    @property
    def failed(self) -> bool:
        return self.phase == FAILED


def argument_values(template: dict, rollout: dict | None, given: dict[str, str]) -> dict[str, str]:
    """``given`` (the pod-template hashes and what ``valueFrom`` would read), then the Rollout's
    values, then the template's defaults."""
    values = {a["name"]: a["value"] for a in template["spec"].get("args", []) if "value" in a}
    if rollout is not None:
        values |= {a["name"]: a["value"] for a in rollout["spec"]["strategy"]["canary"]["analysis"].get("args", [])
                   if "value" in a}
    return values | given


def template_metrics(template: dict, values: dict[str, str]) -> list[Metric]:
    """An AnalysisTemplate's Prometheus metrics with ``{{args.*}}`` resolved from ``values``.

    Raises:
        LookupError: an argument has no value.
        ValueError: a metric that does not query Prometheus.
    """
    def resolve(text: str | None) -> str | None:
        def one(m: re.Match) -> str:
            if m.group(1) not in values:
                raise LookupError(f"analysis argument {m.group(1)!r} has no value")
            return values[m.group(1)]
        return None if text is None else _ARG.sub(one, text)

    out = []
    for m in template["spec"]["metrics"]:
        if "prometheus" not in m.get("provider", {}):
            raise ValueError(f"metric {m['name']!r} does not query Prometheus: {sorted(m.get('provider', {}))}")
        out.append(Metric(m["name"], resolve(m["provider"]["prometheus"]["query"]), resolve(m.get("successCondition")),
                          resolve(m.get("failureCondition")), m.get("interval", ""), m.get("initialDelay"),
                          int(m.get("failureLimit", 0)), int(m.get("inconclusiveLimit", 0)),
                          int(m.get("consecutiveErrorLimit", _DEFAULT_CONSECUTIVE_ERROR_LIMIT))))
    return out


def analysis_metrics(objects: list[dict], given: dict[str, str]) -> list[Metric]:
    """The AnalysisTemplate's metrics with arguments resolved (:func:`argument_values`).

    Raises:
        LookupError: an argument has no value.
    """
    (template,) = [o for o in objects if o["kind"] == "AnalysisTemplate" and o["metadata"]["name"] == "prediction-canary"]
    (rollout,) = [o for o in objects if o["kind"] == "Rollout"]
    return template_metrics(template, argument_values(template, rollout, given))


def measure(metric: Metric, prometheus, at: float | None = None) -> Measurement:
    """One measurement: the query at ``at`` and the phase Argo gives its result."""
    result = [float(sample["value"][1]) for sample in prometheus.query(metric.query, at=at)]
    return Measurement(metric.name, result, phase_of(metric, result))


def phase_of(metric: Metric, result: list[float]) -> str:
    """The measurement's phase for ``result``, as Argo's ``evaluate.EvaluateResult``."""
    try:
        success = bool(evaluate(metric.success_condition, result)) if metric.success_condition else False
        failure = bool(evaluate(metric.failure_condition, result)) if metric.failure_condition else False
    except (IndexError, TypeError):  # expr's runtime errors: an index out of range, NaN where a list was due
        return ERROR
    if not metric.success_condition and not metric.failure_condition:
        return SUCCESSFUL
    if not metric.failure_condition:
        failure = not success
    elif not metric.success_condition:
        success = not failure
    if failure:
        return FAILED
    return SUCCESSFUL if success else INCONCLUSIVE


def run_phase(metrics: list[Metric], measurements: list[Measurement]) -> str:
    """The AnalysisRun's phase after these measurements, as Argo assesses it: a metric over its
    ``failureLimit``, ``inconclusiveLimit`` or ``consecutiveErrorLimit`` is Failed, Inconclusive or
    Error and terminates the run, whose phase is then the worst of them (Failed aborts the Rollout,
    Inconclusive pauses it). RUNNING: no metric over a limit, the Rollout goes on."""
    by_name = {m.name: m for m in metrics}
    completed = []
    for name in {m.metric for m in measurements}:
        metric, phases = by_name[name], [m.phase for m in measurements if m.metric == name]
        consecutive_errors = 0
        for phase in phases:
            consecutive_errors = consecutive_errors + 1 if phase == ERROR else 0
        if phases.count(FAILED) > metric.failure_limit:
            completed.append(FAILED)
        elif phases.count(INCONCLUSIVE) > metric.inconclusive_limit:
            completed.append(INCONCLUSIVE)
        elif consecutive_errors > metric.consecutive_error_limit:
            completed.append(ERROR)
    return max(completed, key=_WORSE.index) if completed else RUNNING


def evaluate(condition: str, result: list[float]) -> object:
    """Evaluates an Argo condition on ``result``.

    Raises:
        ValueError: a construct outside the supported subset.
    """
    text = condition.replace("&&", " and ").replace("||", " or ")
    text = re.sub(r"!(?!=)", " not ", text)
    return _Evaluator(result).visit(ast.parse(text, mode="eval").body)


class _Evaluator(ast.NodeVisitor):
    _COMPARE = {ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b, ast.Lt: lambda a, b: a < b,
                ast.LtE: lambda a, b: a <= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
    _FUNCTIONS = {"len": len, "isNaN": math.isnan, "isInf": math.isinf}

    def __init__(self, result: list[float]) -> None:
        self.result = result

    def generic_visit(self, node: ast.AST) -> object:
        raise ValueError(f"unsupported in an analysis condition: {ast.dump(node)}")

    def visit_BoolOp(self, node: ast.BoolOp) -> object:
        if isinstance(node.op, ast.And):
            return all(self.visit(v) for v in node.values)  # short-circuits, as expr does
        return any(self.visit(v) for v in node.values)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> object:
        if isinstance(node.op, ast.Not):
            return not self.visit(node.operand)
        if isinstance(node.op, ast.USub):
            return -self.visit(node.operand)
        return self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> object:
        left = self.visit(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.visit(right_node)
            if type(op) not in self._COMPARE or not self._COMPARE[type(op)](left, right):
                return False if type(op) in self._COMPARE else self.generic_visit(op)
            left = right
        return True

    def visit_Call(self, node: ast.Call) -> object:
        if not isinstance(node.func, ast.Name) or node.func.id not in self._FUNCTIONS or len(node.args) != 1:
            return self.generic_visit(node)
        return self._FUNCTIONS[node.func.id](self.visit(node.args[0]))

    def visit_Subscript(self, node: ast.Subscript) -> object:
        return self.visit(node.value)[self.visit(node.slice)]

    def visit_Name(self, node: ast.Name) -> object:
        if node.id != "result":
            return self.generic_visit(node)
        return self.result

    def visit_Constant(self, node: ast.Constant) -> object:
        if not isinstance(node.value, (int, float)):
            return self.generic_visit(node)
        return node.value
