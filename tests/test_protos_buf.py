"""buf lint and buf breaking on protos/ (the wire contract), when buf is installed (`make tools`)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import REPO_ROOT

BUF = REPO_ROOT / ".tools" / "node_modules" / ".bin" / "buf"


@pytest.fixture(scope="module")
def buf() -> str:
    if not BUF.exists():
        if os.environ.get("CI") == "true":
            pytest.fail("buf is missing; `make tools` installs it with npm")
        pytest.skip("buf is not installed; run `make tools`")
    return str(BUF)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_protos_pass_buf_lint(buf):
    out = run(buf, "lint")
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_wire_breaking_change_against_the_released_contract(buf):
    out = run(buf, "breaking", "protos", "--against", "protos/baseline.binpb")
    assert out.returncode == 0, out.stdout + out.stderr


def test_buf_breaking_catches_a_removed_field(buf, tmp_path):
    """The check itself can fail: a copy of the protos with a field removed is refused."""
    import shutil

    shutil.copytree(REPO_ROOT / "protos", tmp_path / "protos")
    shutil.copytree(REPO_ROOT / ".tools" / "proto-deps", tmp_path / ".tools" / "proto-deps")
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "protos" / "mlpair" / "prediction" / "v1" / "prediction_service.proto"
    proto.write_text(proto.read_text().replace("  string entity_id = 2;\n", ""))
    out = subprocess.run([buf, "breaking", "protos", "--against", str(REPO_ROOT / "protos" / "baseline.binpb")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "entity_id" in out.stdout + out.stderr
