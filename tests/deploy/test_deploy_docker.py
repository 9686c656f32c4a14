"""Images: hadolint-clean multi-stage Dockerfiles, non-root, gRPC health checks, the right base
and extras (no torch), and a .dockerignore that lets in exactly what `pip install .` needs.

No image is built here (no Docker daemon offline); these checks read the files."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import deploy_checks as dc
import pytest

DOCKER_DIR = dc.DEPLOY_DIR / "docker"
IMAGES = {
    # service: (Dockerfile, pip extra, gRPC port, ENV prefix)
    "inference": (DOCKER_DIR / "inference.Dockerfile", "inference-gpu", 8001, "INFERENCE"),
    "prediction": (DOCKER_DIR / "prediction.Dockerfile", "prediction", 9001, "PREDICTION"),
}
HEAVY = ("torch", "onnxruntime")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    lines = [
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")
    ]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, arguments = line.strip().partition(" ")
            result.append((keyword.upper(), " ".join(arguments.split())))
    return result


def stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (everything from one FROM to the next)."""
    grouped: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions(dockerfile):
        if keyword == "FROM":
            grouped.append([])
        if grouped:
            grouped[-1].append((keyword, arguments))
    return grouped


def arg_default(dockerfile: Path, name: str) -> str:
    for keyword, arguments in instructions(dockerfile):
        if keyword == "ARG" and arguments.startswith(f"{name}="):
            return arguments.split("=", 1)[1]
    raise LookupError(name)


def pyproject() -> dict:
    return tomllib.loads((dc.REPO_ROOT / "pyproject.toml").read_text())


def extra_requirements(extra: str) -> list[str]:
    """An extra's requirements with self-references (mlpair[a,b]) expanded."""
    extras = pyproject()["project"]["optional-dependencies"]
    found: list[str] = []
    for requirement in extras[extra]:
        match = re.match(r"^mlpair\[(.+)\]$", requirement.replace(" ", ""))
        if match:
            for inner in match[1].split(","):
                found += extra_requirements(inner)
        else:
            found.append(requirement)
    return found


# --------------------------------------------------------------------------- hadolint


def _hadolint(hadolint: Path, dockerfile: Path) -> tuple[int, list[dict]]:
    result = subprocess.run(
        [
            str(hadolint),
            "--config",
            str(DOCKER_DIR / "hadolint.yaml"),
            "--format",
            "json",
            str(dockerfile),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, json.loads(result.stdout or "[]")


@pytest.mark.parametrize("service", IMAGES)
def test_dockerfile_passes_hadolint(hadolint: Path, service: str) -> None:
    code, findings = _hadolint(hadolint, IMAGES[service][0])
    assert (code, findings) == (0, [])


def test_hadolint_rejects_the_broken_dockerfile(hadolint: Path, fixtures_dir: Path) -> None:
    code, findings = _hadolint(hadolint, fixtures_dir / "broken" / "root.Dockerfile")
    assert code != 0
    # latest tag, pip cache, unpinned pip package, root user, shell-form CMD.
    assert {"DL3007", "DL3042", "DL3013", "DL3002", "DL3025"} <= {
        finding["code"] for finding in findings
    }


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("service", IMAGES)
def test_image_is_multi_stage_and_runs_as_a_numeric_non_root_user(service: str) -> None:
    groups = stages(IMAGES[service][0])
    assert len(groups) >= 2
    final = groups[-1]
    users = [arguments for keyword, arguments in final if keyword == "USER"]
    assert users, "final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it; the same UID the pods run as.
    assert uid.isdigit() and int(uid) == 10001 and gid == uid
    # The final stage takes the built virtualenv, not the sources or pip's caches.
    copies = [arguments for keyword, arguments in final if keyword == "COPY"]
    assert copies and all(arguments.startswith("--from=") for arguments in copies)
    assert not any(keyword == "RUN" and "pip install" in arguments for keyword, arguments in final)


@pytest.mark.parametrize("service", IMAGES)
def test_healthcheck_uses_the_grpc_health_protocol(service: str, rendered: dict) -> None:
    dockerfile, _, port, prefix = IMAGES[service]
    final = stages(dockerfile)[-1]
    (healthcheck,) = [arguments for keyword, arguments in final if keyword == "HEALTHCHECK"]
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command == ["/opt/venv/bin/mlpair", "health", "--target", f"127.0.0.1:{port}"]
    exposed = [
        int(p) for keyword, arguments in final if keyword == "EXPOSE" for p in arguments.split()
    ]
    assert exposed[0] == port
    env = " ".join(arguments for keyword, arguments in final if keyword == "ENV")
    assert f"{prefix}_PORT={port}" in env
    # The same port Kubernetes probes (deploy settings).
    (config_map,) = [
        c
        for c in dc.of_kind(rendered["prod"], "ConfigMap")
        if f"{prefix}_PORT" in c.get("data", {})
    ]
    assert int(config_map["data"][f"{prefix}_PORT"]) == port


def test_the_prediction_image_exposes_the_relay_s_ports_as_its_deployment_names_them(rendered: dict) -> None:
    # One image runs PredictionService and `mlpair relay`: the relay's health and metrics ports
    # are declared by the image as well as by the prediction-relay Deployment.
    final = stages(IMAGES["prediction"][0])[-1]
    exposed = {int(p) for keyword, arguments in final if keyword == "EXPOSE" for p in arguments.split()}
    (relay,) = [d for d in dc.of_kind(rendered["prod"], "Deployment") if d["metadata"]["name"] == "prediction-relay"]
    ports = {p["containerPort"] for c in dc.containers(relay) for p in c.get("ports", [])}
    assert ports == {9003, 9004} and ports <= exposed


def image_env(dockerfile: Path) -> dict[str, str]:
    """NAME=value pairs of the final stage's ENV instructions."""
    env = {}
    for keyword, arguments in stages(dockerfile)[-1]:
        if keyword == "ENV":
            env.update(pair.split("=", 1) for pair in arguments.split())
    return env


def test_prediction_image_keeps_no_decision_of_its_own() -> None:
    # Every decision goes to the shared ledger (PREDICTION_LEDGER_URL, given at run time): the
    # image declares no volume, creates no folder for the service user to write, and names no
    # ledger or outbox of its own, so nothing a container writes can outlive it unseen.
    final = stages(IMAGES["prediction"][0])[-1]
    assert not [a for k, a in final if k == "VOLUME"]
    runs = " ".join(a for k, a in final if k == "RUN")
    assert "install -d" not in runs and "mkdir" not in runs and "chown" not in runs
    env = image_env(IMAGES["prediction"][0])
    assert not [n for n in env if n.startswith(("PREDICTION_OUTBOX_", "PREDICTION_LEDGER_"))]


def test_inference_image_is_a_cuda_runtime_with_python_311() -> None:
    dockerfile = IMAGES["inference"][0]
    base = arg_default(dockerfile, "CUDA_IMAGE")
    # CUDA 12 + cuDNN (what onnxruntime-gpu's CUDA provider loads), runtime flavour, no compilers.
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-cudnn-runtime-ubuntu22\.04", base), base
    assert all(
        arguments.startswith(("${CUDA_IMAGE}", "python "))
        for keyword, arguments in instructions(dockerfile)
        if keyword == "FROM"
    )
    runs = " ".join(
        arguments for keyword, arguments in instructions(dockerfile) if keyword == "RUN"
    )
    assert "python3.11" in runs


def test_prediction_image_is_slim_python_311() -> None:
    dockerfile = IMAGES["prediction"][0]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", arg_default(dockerfile, "PYTHON_IMAGE"))
    assert all(
        arguments.startswith("${PYTHON_IMAGE}")
        for keyword, arguments in instructions(dockerfile)
        if keyword == "FROM"
    )


@pytest.mark.parametrize("service", IMAGES)
def test_image_installs_only_its_extra_and_refuses_torch(service: str) -> None:
    dockerfile, extra, _, _ = IMAGES[service]
    installs = [a for k, a in instructions(dockerfile) if k == "RUN" and "pip install" in a]
    assert len(installs) == 1
    assert re.findall(r"pip install --no-cache-dir '\.\[([\w,-]+)\]'", installs[0]) == [extra]
    # The build itself fails if torch slipped in through a dependency.
    assert "pip show torch" in installs[0] or "for heavy in torch" in installs[0]
    requirements = " ".join(extra_requirements(extra) + pyproject()["project"]["dependencies"])
    assert not re.search(r"\btorch\b", requirements)
    if service == "prediction":
        assert "onnxruntime" not in requirements
    else:
        assert "onnxruntime-gpu" in requirements and not re.search(
            r"onnxruntime(?!-gpu)", requirements
        )


# --------------------------------------------------------------------------- build context


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for keyword, arguments in instructions(dockerfile):
        if keyword == "COPY" and not arguments.startswith("--from="):
            sources += arguments.split()[:-1]
    return sources


def build_inputs() -> set[str]:
    """What `pip install .` reads: pyproject, its readme and every package-dir's top folder."""
    project = pyproject()
    inputs = {"pyproject.toml"}
    if isinstance(project["project"].get("readme"), str):
        inputs.add(project["project"]["readme"])
    for folder in project["tool"]["setuptools"]["package-dir"].values():
        inputs.add(folder.split("/")[0])
    return inputs


@pytest.mark.parametrize("service", IMAGES)
def test_build_stage_copies_everything_pip_needs(service: str) -> None:
    copied = {source.rstrip("/") for source in copy_sources(IMAGES[service][0])}
    assert build_inputs() <= copied, f"not copied: {sorted(build_inputs() - copied)}"


@pytest.mark.parametrize(
    "source", sorted({s for spec in IMAGES.values() for s in copy_sources(spec[0])})
)
def test_copied_paths_exist(source: str) -> None:
    path = dc.REPO_ROOT / source
    if source == "README.md" and not path.exists():
        pytest.skip(
            "README.md is not written yet (pyproject's readme, so `pip install .` needs it too)"
        )
    assert path.exists()


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context (last matching pattern wins; a
    pattern matching a parent folder matches everything below it; `**` spans folders)."""

    def regex(pattern: str) -> re.Pattern:
        out = ""
        index = 0
        while index < len(pattern):
            if pattern.startswith("**/", index):
                out += "(?:.*/)?"
                index += 3
            elif pattern.startswith("**", index):
                out += ".*"
                index += 2
            elif pattern[index] == "*":
                out += "[^/]*"
                index += 1
            elif pattern[index] == "?":
                out += "[^/]"
                index += 1
            else:
                out += re.escape(pattern[index])
                index += 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        if any(regex(pattern).match(candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_lets_in_exactly_the_build_inputs() -> None:
    patterns = [
        line.strip()
        for line in (dc.REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    for path in [
        "pyproject.toml",
        "README.md",
        "mlpair/__init__.py",
        "services/inference/mlpair/inference/engine.py",
        "services/prediction/mlpair/prediction/recording/__init__.py",
        "mlpair/training/pipeline.py",
    ]:
        assert not dockerignore_excludes(path, patterns), f"{path} is kept out of the build context"
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        "var/models/credit-risk/1/model.onnx",
        "tests/conftest.py",
        "deploy/k8s/base/kustomization.yaml",
        "mlpair/__pycache__/cli.cpython-311.pyc",
        "services/inference/mlpair/inference/__pycache__/engine.cpython-311.pyc",
        "mlpair.egg-info/PKG-INFO",
        "mlpair/_speedups.cpython-311-x86_64-linux-gnu.so",
        ".env",
        "docs/deployment.md",
    ]:
        assert dockerignore_excludes(path, patterns), f"{path} would enter the build context"
    # Every copied source is let in.
    for spec in IMAGES.values():
        for source in copy_sources(spec[0]):
            assert not dockerignore_excludes(source.rstrip("/"), patterns), source
