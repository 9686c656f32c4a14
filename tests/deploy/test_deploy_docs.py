"""The deployment docs point at files that exist: the runbook tells operators exactly which
manifests to edit, so a renamed file must fail here, not during an incident."""

from __future__ import annotations

import re

import deploy_checks as dc
import pytest

DOCS = ["docs/deployment.md", "docs/canary-runbook.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_paths_named_in_the_docs_exist(doc: str) -> None:
    text = (dc.REPO_ROOT / doc).read_text()
    paths = set(re.findall(r"`((?:deploy|docs|config|tests)/[\w./{},*-]+)`", text))
    assert paths, f"{doc} names no repository paths"
    for path in sorted(paths):
        if "*" in path:
            assert list(dc.REPO_ROOT.glob(path)), f"{doc}: nothing matches {path}"
            continue
        # deploy/k8s/base/{inference,prediction}/x.yaml stands for both.
        match = re.match(r"^(.*)\{([\w,]+)\}(.*)$", path)
        expanded = (
            [match[1] + option + match[3] for option in match[2].split(",")] if match else [path]
        )
        for candidate in expanded:
            assert (dc.REPO_ROOT / candidate.rstrip("/")).exists(), (
                f"{doc}: {candidate} does not exist"
            )
