"""ppserve control plane: config, scheduler, coordinator, Serve app, metrics, CLI, bench.

`from app import Engine, EngineConfig, SamplingParams` is the Python API; the names load lazily
so that the pure parts (app.scheduler, app.request) import without Ray or torch.
"""

_EXPORTS = {
    "Engine": "app.engine",
    "EngineConfig": "app.config",
    "SamplingParams": "app.request",
    "RequestOutput": "app.request",
    "InvalidRequest": "app.request",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
