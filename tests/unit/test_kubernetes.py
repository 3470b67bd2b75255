"""deploy/kubernetes/: every object loads into the official kubernetes client's
models without losing a field (a misspelt key would be dropped silently, so
the model is serialised back and compared), and the pod keeps its promises:
native sidecar, probes on /healthz and /readyz, shared /dev/shm and socket,
scrape annotations, the peer-key Secret, one GPU claim for both containers,
and sidecar settings the daemon accepts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="kubernetes client not installed")
yaml = pytest.importorskip("yaml")

from kvsidecar.daemon import settings as settings_mod  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MODELS = {("v1", "Pod"): "V1Pod", ("v1", "Service"): "V1Service",
          ("v1", "Secret"): "V1Secret",
          ("resource.k8s.io/v1", "ResourceClaimTemplate"): "V1ResourceClaimTemplate"}


def objects() -> list[dict[str, Any]]:
    out = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def by_kind(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects() if o["kind"] == kind]
    return obj


def _normalise(x: Any) -> Any:
    """YAML ints in string fields (e.g. defaultMode) and the like compare as JSON does."""
    return json.loads(json.dumps(x))


@pytest.mark.parametrize("obj", objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_object_loads_into_client_model_without_loss(obj: dict[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key == ("monitoring.coreos.com/v1", "ServiceMonitor"):
        pytest.skip("CRD: no model in the kubernetes client; checked in test_service_monitor")
    api = kubernetes.client.ApiClient()
    model = api.deserialize(json.dumps(obj), MODELS[key], "application/json")
    assert type(model).__name__ == MODELS[key]
    assert _normalise(api.sanitize_for_serialization(model)) == _normalise(obj)


def sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "kvsidecar"]
    return c


def test_pod_runs_kvsidecar_as_native_sidecar_with_probes() -> None:
    pod = by_kind("Pod")
    sc = sidecar(pod)
    assert sc["restartPolicy"] == "Always"
    assert sc["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in sc["ports"]}
    assert sc["livenessProbe"]["httpGet"]["port"] == "metrics"
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == ports["metrics"]
    # Longer than the sidecar's drain (read timeout 60 s + 15 s, open holds
    # --drain-timeout 30 s, 2 s of polls); the engine stops first, in the same period.
    s = settings_mod.Settings(socket="x")
    drain = s.read_timeout_s + 15 + s.drain_timeout_s + 2
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain


def test_pod_shares_shm_socket_gpu_and_keys() -> None:
    pod = by_kind("Pod")
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    engine = pod["spec"]["containers"][0]
    sc = sidecar(pod)
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
              for c in (engine, sc)}
    assert vols[mounts["engine"]["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert mounts["engine"]["/dev/shm"] == mounts["kvsidecar"]["/dev/shm"]
    assert mounts["engine"]["/run/kvsidecar"] == mounts["kvsidecar"]["/run/kvsidecar"]
    env = {e["name"]: e.get("value") for e in sc["env"]}
    assert env["KVSIDECAR_SOCKET"].startswith("/run/kvsidecar/")
    assert env["KVSIDECAR_SOCKET"] in " ".join(engine["args"])
    keys = vols["peer-keys"]["secret"]["secretName"]
    assert keys == by_kind("Secret")["metadata"]["name"]
    assert set(by_kind("Secret")["stringData"]) == {"sidecar.key_secret", "sidecar.key"}
    assert env["KVSIDECAR_PEER_KEYS"] in mounts["kvsidecar"]
    claim = pod["spec"]["resourceClaims"][0]
    template = by_kind("ResourceClaimTemplate")["metadata"]["name"]
    assert claim["resourceClaimTemplateName"] == template
    for c in (engine, sc):
        assert c["resources"]["claims"] == [{"name": claim["name"]}]
    assert pod["spec"]["shareProcessNamespace"] is True


def test_sidecar_environment_is_accepted_by_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    for e in sidecar(by_kind("Pod"))["env"]:
        if e["name"] == "KVSIDECAR_PEER_KEYS":
            continue  # a directory the Secret provides at run time
        monkeypatch.setenv(e["name"], e.get("value", "10.0.0.1"))  # valueFrom: a pod IP
    p = argparse.ArgumentParser()
    settings_mod.add_arguments(p)
    s = settings_mod.from_args(p.parse_args([]))
    assert s.metrics_port == 9100 and s.handshake_port == 5600
    assert s.log_format == "json" and s.transport_check == "allow-tcp"


def test_service_monitor_selects_the_service_port() -> None:
    sm, svc = by_kind("ServiceMonitor"), by_kind("Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
    pod_labels = by_kind("Pod")["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())


def test_the_engine_can_import_the_connector_module() -> None:
    """The engine runs stock vLLM, which has no kvsidecar: an init container
    from the sidecar's image (so the same version) copies the package into a
    volume, before the native sidecar and the engine start, and the engine puts
    that volume on PYTHONPATH (once nothing installed it: the connector named
    by kv_connector_module_path could not be imported)."""
    pod = by_kind("Pod")
    engine = pod["spec"]["containers"][0]
    config = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    module = config["kv_connector_module_path"]
    assert module == "kvsidecar.integrations.vllm"
    inits = pod["spec"]["initContainers"]
    (lib,) = [c for c in inits if c["name"] == "kvsidecar-lib"]
    assert inits.index(lib) < inits.index(sidecar(pod))  # done before anything runs
    assert "restartPolicy" not in lib  # a plain init container: runs to completion
    assert lib["image"] == sidecar(pod)["image"]
    (lib_mount,) = lib["volumeMounts"]
    command = " ".join(lib["command"])
    assert "import os, shutil, kvsidecar" in command
    assert f"'{lib_mount['mountPath']}/kvsidecar'" in command
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    paths = (env.get("PYTHONPATH") or "").split(":")
    engine_mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    assert engine_mounts.get(lib_mount["name"]) in paths
    volume = {v["name"]: v for v in pod["spec"]["volumes"]}[lib_mount["name"]]
    assert "emptyDir" in volume
