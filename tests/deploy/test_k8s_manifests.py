"""deploy/k8s validates offline against the Kubernetes schemas and has what running the pools
needs: the Secret, probes, drains that fit the grace period, a PDB and an HPA per pool, no
wildcard binds, and arguments every role's CLI accepts."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest

from pdserve.cli.main import build_parser
from tests.deploy.manifests import K8S, by_kind, documents, entrypoint, resource_files

VERSION = "1.30.0"
POOLS = ("pdserve-prefill", "pdserve-decode")


def test_every_manifest_validates_against_the_kubernetes_schemas():
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Service", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)
    # and the check can fail: a misspelt field is refused
    broken = copy.deepcopy(by_kind("Deployment")["pdserve-decode"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    listed = {p.name for p in resource_files()}
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "prometheus-adapter-values.yaml"}
    assert listed == present


def test_pools_drain_within_their_grace_period_and_have_probes_budgets_and_autoscalers():
    deployments = by_kind("Deployment")
    hpas = {h["spec"]["scaleTargetRef"]["name"] for h in by_kind("HorizontalPodAutoscaler").values()}
    pdbs = {p["spec"]["selector"]["matchLabels"]["app"] for p in by_kind("PodDisruptionBudget").values()}
    for name in POOLS:
        spec = deployments[name]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        args = c["args"]
        drain = float(args[args.index("--drain-timeout") + 1])
        assert spec["terminationGracePeriodSeconds"] > drain + 5
        assert "kill -TERM 1" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert name in hpas and name in pdbs


def test_no_wildcard_binds_and_the_secret_comes_from_a_secret():
    for dep in by_kind("Deployment").values():
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        text = " ".join(c["args"])
        assert not re.search(r"0\.0\.0\.0|tcp://\*|--allow-wildcard-bind", text), text
        (secret,) = [e for e in c["env"] if e["name"] == "PDSERVE_CLUSTER_SECRET"]
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "pdserve-cluster", "key": "secret"}


def test_container_arguments_parse_with_the_cli():
    assert entrypoint() == ["pdserve"]
    parser = build_parser()
    for dep in by_kind("Deployment").values():
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        args = parser.parse_args(c["args"])  # a flag the CLI lacks fails here (SystemExit)
        assert args.command in ("gateway", "prefill", "decode")
