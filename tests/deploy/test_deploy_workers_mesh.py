"""C55 in the rendered manifests: the sidecar of every serving pod spreads the calls it forwards
over the pod's serving processes (``*_WORKERS``), which share one port and are reached only by
new connections (tests/e2e/test_workers_behind_a_proxy.py measures it)."""

from __future__ import annotations

import deploy_checks as dc
import pytest

SERVING = ("inference", "prediction")


def sidecar_for(objects: list[dict], workload: dict) -> list[dict]:
    """The Sidecars whose workload selector picks ``workload``'s pods."""
    return [s for s in dc.of_kind(objects, "Sidecar")
            if dc.selector_matches({"matchLabels": s["spec"]["workloadSelector"]["labels"]}, dc.pod_labels(workload))]


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_c55_every_serving_pods_sidecar_renews_and_spreads_its_connections_to_the_workers(
        rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    checked = 0
    for app in SERVING:
        rule = dc.by_name(objects, "DestinationRule", app)
        for workload in dc.workloads(objects, app):
            (sidecar,) = sidecar_for(objects, workload)  # one: Istio picks an arbitrary one of several
            pool = sidecar["spec"]["inboundConnectionPool"]
            http = pool["http"]
            # a new connection once 8 calls share one, and a fresh one every 32 calls
            assert 0 < http["maxConcurrentStreams"] <= 8, (overlay, app, http)
            assert 0 < http["maxRequestsPerConnection"] <= 32, (overlay, app, http)
            # the inbound cluster takes the Sidecar's pool instead of the DestinationRule's: the same limits
            inherited = {**pool, "http": {k: v for k, v in http.items()
                                          if k not in ("maxConcurrentStreams", "maxRequestsPerConnection")}}
            assert inherited == rule["spec"]["trafficPolicy"]["connectionPool"], (overlay, app)
            checked += 1
    assert checked >= len(SERVING)

