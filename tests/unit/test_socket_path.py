"""The vLLM connector looks for its sidecar where ``kvsidecar serve`` listens by
default, whatever the environment (they once disagreed without XDG_RUNTIME_DIR)."""

from __future__ import annotations

import os

import pytest

from kvsidecar.daemon.settings import add_arguments, from_args
from kvsidecar.integrations.vllm.layout import UnsupportedConfig
from kvsidecar.integrations.vllm.settings import Settings as ConnectorSettings


def _serve_default(device: str) -> str:
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(["--device", device])).socket


@pytest.mark.parametrize("env", [
    {},
    {"XDG_RUNTIME_DIR": "/run/user/1000"},
    {"RUNTIME_DIRECTORY": "/run/kvsidecar"},
    {"RUNTIME_DIRECTORY": "/run/a:/run/b", "XDG_RUNTIME_DIR": "/run/user/7"},
], ids=["none", "xdg", "systemd", "both"])
@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_connector_and_serve_agree_on_the_default_socket(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], device: str) -> None:
    for name in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", "KVSIDECAR_SOCKET", "KVSIDECAR_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    served = _serve_default(device)
    assert ConnectorSettings.from_extra({}).socket_for(0, 0, device) == served
    if not env:
        assert served == f"/tmp/kvsidecar-{os.geteuid()}/{device.replace(':', '')}.sock"


@pytest.mark.parametrize("hold", [0, -1, 3600.5, 7200])
def test_a_hold_timeout_the_sidecar_would_refuse_is_refused_at_start_up(hold: float) -> None:
    """The scheduler hands out each hold's token before its worker holds: a
    timeout P's sidecar refuses on every hold must stop the connector first."""
    with pytest.raises(UnsupportedConfig, match="hold_timeout_s"):
        ConnectorSettings.from_extra({"hold_timeout_s": hold})
    assert ConnectorSettings.from_extra({"hold_timeout_s": 3600}).hold_timeout_s == 3600


def test_a_gpu_worker_looks_for_its_own_gpus_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM names a GPU worker's device type only (``cuda``); its default socket
    is the one ``kvsidecar serve --device cuda:N`` listens on for the worker's
    own GPU N (it once looked for ``cuda.sock``, which no sidecar serves)."""
    from kvsidecar.integrations.vllm.settings import socket_device

    for name in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", "KVSIDECAR_SOCKET", "KVSIDECAR_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    settings = ConnectorSettings.from_extra({})
    assert settings.socket_for(0, 0, socket_device("cuda", 1)) == _serve_default("cuda:1")
    assert settings.socket_for(0, 0, socket_device("cpu", None)) == _serve_default("cpu")
