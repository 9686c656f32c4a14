"""PredictionService's layering, read from the source with ``ast`` (nothing is imported).

* ``scoring/`` is the request's path in order — cache → coalescer → resilience → inference client —
  says so in its docstring, and each layer is built once, in ``scoring/factory.py``, and injected.
* The decision domain (``records.py``) and the pipeline that makes decisions load no SQLAlchemy
  and no ``crm`` module when imported; the database encoding lives in ``crm/codecs.py``.
* ``x-feature-version`` is spelled once in the product: ``mlpair.contracts.FEATURE_VERSION_KEY``.
* The scoring signatures take one :class:`~mlpair.contracts.target.ModelTarget`, and the logits
  reach calibration as one matrix (:class:`~mlpair.prediction.scoring.rows.ScoredRows`).
* The stages in request order — preparing, scoring, deciding, recording — never import a later
  one when loaded, and each stage has one implementation: one place makes a ``Group``, one scores
  it into ``GroupScores`` (both frozen), one encoder writes a ``PredictResponse``, one statement
  per ledger engine commits.
"""

from __future__ import annotations

import ast
import functools

import pytest

from tests.support.source import import_graph, import_time_imports, product_modules

pytestmark = pytest.mark.timeout(60)

SCORING = "mlpair.prediction.scoring"


@functools.cache
def tree(module: str) -> ast.Module:
    path = product_modules()[module]
    return ast.parse(path.read_text(), str(path))


def function(module: str, qualified: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The definition of ``name`` or ``Class.name`` in ``module``."""
    *owner, name = qualified.split(".")
    body = tree(module).body
    if owner:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner[0]).body
    return next(n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def import_time_closure(module: str) -> set[str]:
    """``module`` and every product module it loads, transitively, when it is imported."""
    graph = import_graph(product_modules())
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def imported_roots(module: str, *, at_import_time: bool) -> set[str]:
    """The top-level package names ``module`` imports (at import time only, or anywhere in it)."""
    nodes = (
        import_time_imports(tree(module))
        if at_import_time
        else [n for n in ast.walk(tree(module)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    )
    roots = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def constructed(name: str) -> set[str]:
    """The product modules that call ``name(...)``."""
    return {
        module
        for module in product_modules()
        if any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
            for n in ast.walk(tree(module))
        )
    }


def test_the_scoring_package_holds_the_request_path_and_its_docstring_gives_the_order():
    modules = {name for name in product_modules() if name == SCORING or name.startswith(SCORING + ".")}
    assert modules == {
        SCORING,
        *(f"{SCORING}.{m}" for m in ("backends", "cache", "calibration", "client", "coalescer", "factory", "keys",
                                     "redis_backend",
                                     "resilience", "rows", "scorer")),
    }
    doc = ast.get_docstring(tree(SCORING)) or ""
    steps = [doc.find(f"**{layer}**") for layer in ("cache", "coalescer", "resilience", "inference client")]
    assert -1 not in steps and steps == sorted(steps), steps
    for gone in ("cache", "cache_backends", "coalesce", "resilience", "inference_client", "scoring.py"):
        assert f"mlpair.prediction.{gone}" not in product_modules()


def test_each_scoring_layer_is_built_only_by_the_factory_and_knows_only_the_next():
    assert constructed("InferenceCoalescer") == {f"{SCORING}.factory"}
    assert constructed("CachedInference") == {f"{SCORING}.factory"}
    graph = import_graph(product_modules())
    assert f"{SCORING}.client" not in graph[f"{SCORING}.cache"] | graph[f"{SCORING}.coalescer"]
    assert f"{SCORING}.resilience" not in graph[f"{SCORING}.cache"]
    init = [p.annotation for p in function(f"{SCORING}.cache", "CachedInference.__init__").args.args[1:]]
    assert [ast.unparse(a) for a in init if a is not None] == ["InferenceCoalescer", "LogitsCache"]


@pytest.mark.parametrize("module", ["mlpair.prediction.pipeline", "mlpair.prediction.records"])
def test_the_decision_path_loads_no_database_layer(module):
    closure = import_time_closure(module)
    assert not {m for m in closure if m.startswith("mlpair.prediction.recording")}, sorted(closure)
    loading_sqlalchemy = {m for m in closure if "sqlalchemy" in imported_roots(m, at_import_time=True)}
    assert loading_sqlalchemy == set()


def test_records_import_no_database_code_anywhere_and_codecs_encode_them():
    assert "sqlalchemy" not in imported_roots("mlpair.prediction.records", at_import_time=False)
    assert not any("crm" in m for m in import_graph(product_modules())["mlpair.prediction.records"])
    defined = {n.name for n in tree("mlpair.prediction.records").body if isinstance(n, ast.ClassDef)}
    assert {"StoredDecision", "Recorded", "DecisionColumns", "RecordedBatch"} <= defined
    codecs = {n.name for n in tree("mlpair.prediction.recording.codecs").body if isinstance(n, ast.FunctionDef)}
    assert {"from_record", "crm_row", "to_json", "from_json", "ledger_columns"} <= codecs
    assert "mlpair.prediction.recording.columns" not in product_modules()


def test_the_feature_version_key_is_spelled_once_in_the_product():
    assignments, literals = [], []
    for module in product_modules():
        for node in ast.walk(tree(module)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "FEATURE_VERSION_KEY" for t in targets):
                assignments.append(module)
            if isinstance(node, ast.Constant) and node.value == "x-feature-version":
                literals.append(module)
    # mlpair.client ships alone too (clients/python, without mlpair.contracts): its one spelling is
    # held equal to the contract's here and in tests/test_client_install.py
    assert sorted(assignments) == sorted(literals) == ["mlpair.client.inference", "mlpair.contracts"]
    from mlpair.client import inference as client_inference
    from mlpair.contracts import FEATURE_VERSION_KEY

    assert client_inference.FEATURE_VERSION_KEY == FEATURE_VERSION_KEY
    for user in ("mlpair.prediction.scoring.client", "mlpair.inference.converters", "mlpair.wire"):
        assert any(
            isinstance(n, ast.ImportFrom) and n.module == "mlpair.contracts" and "FEATURE_VERSION_KEY" in {a.name for a in n.names}
            for n in ast.walk(tree(user))
        ), user


@pytest.mark.parametrize(
    ("module", "name"),
    [
        (f"{SCORING}.client", "InferenceClient.infer"),
        (f"{SCORING}.coalescer", "InferenceCoalescer.infer"),
        (f"{SCORING}.cache", "CachedInference.score"),
        (f"{SCORING}.keys", "cache_key"),
    ],
)
def test_scoring_signatures_take_one_model_target(module, name):
    args = function(module, name).args
    params = [a for a in args.args if a.arg != "self"]
    assert params[0].arg == "target" and ast.unparse(params[0].annotation) == "ModelTarget"
    names = {a.arg for a in [*args.args, *args.kwonlyargs]}
    assert not names & {"model_name", "model_version", "feature_version", "feature_schema_version"}


def test_logits_reach_calibration_as_one_matrix():
    score = function(f"{SCORING}.cache", "CachedInference.score")
    assert ast.unparse(score.returns) == "ScoredRows"
    scorer = tree(f"{SCORING}.scorer")
    assert "_stack" not in {n.name for n in scorer.body if isinstance(n, ast.FunctionDef)}
    # logits are read only off a whole ScoredRows, never row by row to be stacked again
    # (``answer`` is _rows_at's ScoredRows, whose rows it hands out as views of the matrix)
    reads = sorted({ast.unparse(n) for n in ast.walk(scorer) if isinstance(n, ast.Attribute) and n.attr == "logits"})
    assert reads == ["a.logits", "answer.logits", "answers[0].logits"]
    infer = next(n for n in scorer.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "Infer")
    assert ast.unparse(infer.value).endswith("Awaitable[ScoredRows]]")
    calibrated = [
        ast.unparse(n.args[0])
        for n in ast.walk(scorer)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "probabilities_per_row"
    ]
    assert calibrated == ["a.logits"]


STAGES = ("preparing", "scoring", "deciding", "recording")  # in request order


def test_no_stage_imports_a_later_stage_when_loaded():
    graph = import_graph(product_modules())
    later_of = {stage: STAGES[k + 1 :] for k, stage in enumerate(STAGES)}
    reaching = sorted(
        (module, target)
        for module, targets in graph.items()
        for stage, later in later_of.items()
        if module.startswith(f"mlpair.prediction.{stage}.")
        for target in targets
        if any(target.startswith(f"mlpair.prediction.{name}") for name in later)
    )
    assert reaching == []


def _frozen(module: str, name: str) -> bool:
    (cls,) = [n for n in tree(module).body if isinstance(n, ast.ClassDef) and n.name == name]
    return any(
        isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
        for d in cls.decorator_list
    )


def test_each_stage_has_one_implementation_and_its_results_are_values():
    assert constructed("Group") == {"mlpair.prediction.preparing.batch"}  # preparing.batch.prepare alone
    assert constructed("GroupScores") == {"mlpair.prediction.scoring.scorer"}
    assert _frozen("mlpair.prediction.preparing.batch", "Group")
    assert _frozen("mlpair.prediction.scoring.scorer", "GroupScores")
    assert constructed("Decided") == {"mlpair.prediction.deciding.decisions"}  # deciding.decisions.decide alone
    assert _frozen("mlpair.prediction.deciding.decisions", "Decided")
    assemblers = {  # one assembler, shared by training and serving: its row path is its small-batch shortcut
        (module, n.name)
        for module in product_modules()
        for n in tree(module).body
        if isinstance(n, ast.ClassDef) and n.name.endswith("Assembler")
    }
    assert assemblers == {("mlpair.contracts.assembly", "FeatureAssembler"), ("mlpair.contracts.columns", "ColumnAssembler")}
    (policy,) = [n for n in tree("mlpair.prediction.deciding.policy").body
                 if isinstance(n, ast.ClassDef) and n.name == "DecisionPolicy"]
    methods = {n.name for n in policy.body if isinstance(n, ast.FunctionDef)}
    assert "decide_many" not in methods and {"decide", "verdict_code", "verdict"} <= methods  # one routing rule
    writers = {  # a response's decision fields are written in one place
        module
        for module in product_modules()
        if module.startswith("mlpair.prediction.")
        for n in ast.walk(tree(module))
        if isinstance(n, ast.Attribute) and n.attr == "decision_label" and isinstance(n.ctx, ast.Store)
        or isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "PredictResponse"
    }
    assert writers == {"mlpair.prediction.intake.converters"}
    for engine, name in (("ledger_postgres", "PostgresLedger"), ("ledger_sqlite", "SqliteLedger")):
        (cls,) = [n for n in tree(f"mlpair.prediction.recording.{engine}").body
                  if isinstance(n, ast.ClassDef) and n.name == name]
        commits = {n.name for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name.startswith("_commit")}
        assert commits == {"_commit_rows"}, engine
