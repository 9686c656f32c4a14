"""The canary analysis of the prod overlay, as Argo Rollouts runs it, against any Prometheus.

The metrics come from the rendered manifests (``kubectl kustomize deploy/k8s/overlays/prod``: the
AnalysisTemplate ``prediction-canary`` and the Rollout's ``analysis.args``), never from a copy:
:func:`analysis_metrics` resolves ``{{args.*}}`` as Argo does (a value from the Rollout, else the
template's default; the pod-template hashes are given, as Argo passes them), and
:func:`measure` evaluates a metric's ``failureCondition`` on the query's result the way Argo's
expression language reads it (``result`` is the list of the vector's values). Only the small part
of that language the manifests use is accepted: comparisons, ``&&``, ``||``, ``!``, ``len()``,
``isNaN()``, indexing and numbers; anything else is refused rather than guessed.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass

_ARG = re.compile(r"\{\{\s*args\.([\w-]+)\s*\}\}")


@dataclass(frozen=True)
class Metric:
    """One analysis metric with every argument resolved."""

    name: str
    query: str
    failure_condition: str
    interval: str


@dataclass(frozen=True)
class Measurement:
    metric: str
    result: list[float]
    failed: bool


def analysis_metrics(objects: list[dict], given: dict[str, str]) -> list[Metric]:
    """The AnalysisTemplate's metrics with arguments resolved: ``given`` (the pod-template hashes
    and what ``valueFrom`` would read), then the Rollout's values, then the template's defaults.

    Raises:
        LookupError: an argument has no value.
    """
    (template,) = [o for o in objects if o["kind"] == "AnalysisTemplate"]
    (rollout,) = [o for o in objects if o["kind"] == "Rollout"]
    values = {a["name"]: a["value"] for a in template["spec"]["args"] if "value" in a}
    values |= {a["name"]: a["value"] for a in rollout["spec"]["strategy"]["canary"]["analysis"]["args"] if "value" in a}
    values |= given

    def resolve(text: str) -> str:
        def one(m: re.Match) -> str:
            if m.group(1) not in values:
                raise LookupError(f"analysis argument {m.group(1)!r} has no value")
            return values[m.group(1)]
        return _ARG.sub(one, text)

    return [Metric(m["name"], resolve(m["provider"]["prometheus"]["query"]), resolve(m["failureCondition"]),
                   m["interval"]) for m in template["spec"]["metrics"]]


def measure(metric: Metric, prometheus, at: float | None = None) -> Measurement:
    """One measurement: the query at ``at`` and whether the failure condition holds."""
    result = [float(sample["value"][1]) for sample in prometheus.query(metric.query, at=at)]
    return Measurement(metric.name, result, bool(evaluate(metric.failure_condition, result)))


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
    _FUNCTIONS = {"len": len, "isNaN": math.isnan}

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
