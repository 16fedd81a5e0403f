"""The Kubernetes manifests (deploy/k8s) as data, and what a kubelet would run for a pod of
them: the container's command and arguments with $(VAR) expanded from its env (the pod IP,
the Secret's keys), Service names resolved to the pod behind them, volume mounts to folders."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
DOCKERFILE = K8S.parent / "Dockerfile"


def resource_files() -> list[Path]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [K8S / name for name in kustomization["resources"]]


def documents() -> list[dict]:
    return [doc for path in resource_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT (exec form) from the Dockerfile."""
    (line,) = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    return yaml.safe_load(line.removeprefix("ENTRYPOINT"))


@dataclass
class PodCommand:
    argv: list[str]
    env: dict[str, str]
    probes: dict[str, str]  # readiness / liveness -> URL


def pod_command(
    deployment: dict, pod_ip: str, service_ips: dict[str, str], secrets: dict[str, str], mounts: dict[str, Path]
) -> PodCommand:
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", source
            env[var["name"]] = pod_ip
        else:
            ref = source["secretKeyRef"]
            value = secrets.get(f"{ref['name']}/{ref['key']}")
            if value is None:
                assert ref.get("optional"), f"secret {ref} missing"
                continue
            env[var["name"]] = value
    paths = {m["mountPath"]: mounts[m["name"]] for m in container.get("volumeMounts", [])}

    def expand(arg: str) -> str:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)  # kubelet's rule
        for name, ip in service_ips.items():  # cluster DNS
            arg = re.sub(rf"(?<=//){re.escape(name)}(?=:)", ip, arg)
        for mount, local in paths.items():
            if arg == mount or arg.startswith(mount + "/"):
                arg = str(local) + arg[len(mount) :]
        return arg

    command = container.get("command") or entrypoint()
    argv = [expand(a) for a in command + container.get("args", [])]
    if argv[0] == "pdserve":  # the console script, run by this interpreter
        argv = [sys.executable, "-m", "pdserve.cli", *argv[1:]]
    probes = {}
    for kind in ("readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        probes[kind] = f"http://{pod_ip}:{get['port']}{get['path']}"
    return PodCommand(argv, env, probes)
