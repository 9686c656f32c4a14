"""deploy/k8s/apply.sh, the kubectl way to release an overlay: the schema migration Job first, the
rest of the render only after the Job completed, nothing more if it failed.

The script runs for real against a stand-in for kubectl (KUBECTL): `kustomize` is the real
kubectl's, `apply -f FILE -l SELECTOR` records which objects of FILE the label selector picks (as
kubectl filters them), `get job` answers the Job's conditions from a scripted sequence, and every
call is logged in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import deploy_checks as dc
import ledger_checks as lc

SCRIPT = dc.K8S_DIR / "apply.sh"

FAKE_KUBECTL = r"""#!{python}
import json, os, re, subprocess, sys
import yaml

args = sys.argv[1:]
log = open(os.environ["FAKE_LOG"], "a")
if args[0] == "kustomize":
    result = subprocess.run([os.environ["REAL_KUBECTL"], *args], capture_output=True, text=True)
    sys.stdout.write(result.stdout)
    entry = {{"call": "kustomize"}}
elif args[0] == "apply":
    path, selector = args[args.index("-f") + 1], args[args.index("-l") + 1]
    key, operator, value = re.fullmatch(r"([^!=]+)(!=|=)(.*)", selector).groups()
    picked = []
    for obj in yaml.safe_load_all(open(path)):
        if obj and (obj["metadata"].get("labels", {{}}).get(key) == value) == (operator == "="):
            picked.append(obj["kind"] + "/" + obj["metadata"]["name"])
    entry = {{"call": "apply", "selector": selector, "objects": picked}}
elif "delete" in args:
    entry = {{"call": "delete", "args": args}}
elif "get" in args:
    states = os.environ["FAKE_JOB_STATES"].split(",")
    polls = sum(1 for line in open(os.environ["FAKE_LOG"]) if '"get"' in line)
    print(states[min(polls, len(states) - 1)], end="")
    entry = {{"call": "get", "args": args}}
else:
    sys.exit("unexpected kubectl call: " + " ".join(args))
log.write(json.dumps(entry) + "\n")
"""


def run_apply(
    tmp_path: Path, kubectl: Path, states: str, **env: str
) -> tuple[int, list[dict], str]:
    """Runs apply.sh prod with the stand-in; returns its exit status, the calls and stderr."""
    fake = tmp_path / "kubectl"
    fake.write_text(FAKE_KUBECTL.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.touch()
    result = subprocess.run(
        ["bash", str(SCRIPT), "prod"],
        env={
            **os.environ,
            "KUBECTL": str(fake),
            "REAL_KUBECTL": str(kubectl),
            "FAKE_LOG": str(log),
            "FAKE_JOB_STATES": states,
            "POLL_S": "0",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return result.returncode, calls, result.stderr


def test_the_script_is_valid_bash() -> None:
    result = subprocess.run(
        ["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_release_migrates_first_and_rolls_once_the_job_is_complete(
    tmp_path: Path, kubectl: Path, rendered: dict
) -> None:
    # Running twice (newer API servers report SuccessCriteriaMet before Complete), then Complete.
    code, calls, stderr = run_apply(
        tmp_path, kubectl, ",,SuccessCriteriaMet,SuccessCriteriaMet Complete"
    )
    assert code == 0, stderr
    assert [c["call"] for c in calls] == [
        "kustomize",
        "delete",
        "apply",
        "get",
        "get",
        "get",
        "get",
        "apply",
    ]
    # The previous release's Job goes first: Jobs are immutable.
    assert calls[1]["args"][:5] == ["-n", "mlpair", "delete", "job", lc.MIGRATE_JOB]
    first, rest = lc.phases(rendered["prod"])
    assert sorted(calls[2]["objects"]) == sorted(dc.name_of(o) for o in first)
    assert sorted(calls[-1]["objects"]) == sorted(dc.name_of(o) for o in rest)
    assert all(c["args"][:5] == ["-n", "mlpair", "get", "job", lc.MIGRATE_JOB] for c in calls[3:7])


def test_a_failed_migration_rolls_nothing(tmp_path: Path, kubectl: Path) -> None:
    code, calls, stderr = run_apply(tmp_path, kubectl, ",FailureTarget,FailureTarget Failed")
    assert code == 1
    assert "job/prediction-migrate failed; nothing else was applied" in stderr
    applied = [c for c in calls if c["call"] == "apply"]
    assert [c["selector"] for c in applied] == [f"{lc.PHASE_LABEL}={lc.PHASE_MIGRATE}"]


def test_a_migration_that_never_finishes_rolls_nothing(tmp_path: Path, kubectl: Path) -> None:
    code, calls, stderr = run_apply(tmp_path, kubectl, "", MIGRATE_TIMEOUT_S="0")
    assert code == 1
    assert "not complete after 0 s" in stderr
    assert [c["call"] for c in calls] == ["kustomize", "delete", "apply", "get"]


def test_an_unknown_overlay_is_refused_before_any_call(tmp_path: Path, kubectl: Path) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), "staging"],
        env={**os.environ, "KUBECTL": str(tmp_path / "absent")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "no overlay folder" in result.stderr
