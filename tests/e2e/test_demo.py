"""`mlpair demo` as a user runs it: real processes, both families' holdouts, a report, clean stop."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys

from tests.support import CONFIG_DIR, slim_environment


def test_demo_scores_every_holdout_record_once_and_writes_the_report(model_repository, credit_holdout, churn_holdout,
                                                                     tmp_path):
    (tmp_path / "slim").mkdir()
    out = subprocess.run(  # with only what `make demo` installs (mlpair[demo]) importable
        [sys.executable, "-m", "mlpair.cli", "demo", "--model-repository", str(model_repository),
         "--workdir", str(tmp_path), "--config-dir", str(CONFIG_DIR)],
        capture_output=True, text=True, timeout=300, env={**slim_environment(tmp_path / "slim"), "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK" in out.stdout
    for family in ("credit-risk", "churn"):
        assert f"{family} (model version" in out.stdout
    for line in ("holdout ROC AUC (returned probabilities)", "Brier score before → after calibration",
                 "ECE (15 bins) before → after calibration"):
        assert out.stdout.count(line) == 2
    assert "MISSED" not in out.stdout
    # The summary explains itself: concurrency, training's end, the classical baseline, the CRM count.
    assert out.stdout.count("client latency p50 / p99 at 32 in flight") == 2
    assert "credit-risk version 1: reused (up to date), stopped early at epoch " in out.stdout
    for family in ("credit-risk", "churn"):
        served = float(re.search(rf"{family} \(model version.*?holdout ROC AUC \(returned probabilities\) *│? *"
                                 r"(\d\.\d{4})", out.stdout, re.S).group(1))
        baseline, difference = re.search(rf"{family} \(model version.*?holdout ROC AUC, logistic regression *│? *"
                                         r"(\d\.\d{4})  \(same split and features; served model ([+-]\d\.\d{4})\)",
                                         out.stdout, re.S).groups()
        assert 0.7 < float(baseline) < 1.0 and abs(served - float(baseline) - float(difference)) < 2e-4
        # the holdout's true labels fed back: PredictionService's realised ROC AUC is the client's
        realised = float(re.search(rf"{family} \(model version.*?realised ROC AUC / ECE / Brier \(service\) *│? *"
                                   r"(\d\.\d{4})", out.stdout, re.S).group(1))
        assert realised == served
    assert out.stdout.count("outcomes fed back (RecordOutcomes)") == 2
    holdout = len(credit_holdout.records) + len(churn_holdout.records)
    assert (f"CRM rows written: {holdout + 6} = {holdout} holdout decisions + 6 explain calls (BatchPredict, 3 per "
            "family, own request ids); the 100 retries reused request ids and added none (one row per request id: yes)"
            ) in out.stdout.replace("\n", " ")
    db = sqlite3.connect(tmp_path / "crm.sqlite")
    per_family = dict(db.execute("select model_name, count(distinct request_id) from decisions "
                                 "where request_id not like '%-explain-%' group by model_name").fetchall())
    assert per_family == {"credit-risk": len(credit_holdout.records), "churn": len(churn_holdout.records)}
    assert db.execute("select count(*) - count(distinct request_id) from decisions").fetchone() == (0,)
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 50_000
