"""`mlpair demo` as a user runs it: real processes, real holdout, clean stop."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from tests.support import CONFIG_DIR


def test_demo_scores_every_holdout_applicant_once(model_repository, credit_holdout, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlpair.cli", "demo", "--model-repository", str(model_repository),
         "--workdir", str(tmp_path), "--config-dir", str(CONFIG_DIR)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK" in out.stdout and "holdout ROC AUC" in out.stdout
    rows = sqlite3.connect(tmp_path / "crm.sqlite").execute(
        "select count(*), count(distinct request_id) from decisions").fetchone()
    assert rows == (len(credit_holdout.records), len(credit_holdout.records))
