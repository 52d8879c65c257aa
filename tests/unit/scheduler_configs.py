"""SchedulerConfigs for the scheduler's tests: EngineConfig's defaults (the one definition of
every option), with the fields a test names (the scheduler's names) replaced."""

from __future__ import annotations

import dataclasses
from typing import Any

from app.config import EngineConfig
from app.scheduler import SchedulerConfig


def scheduler_config(
    *, num_blocks: int = 1024, max_model_len: int = 1 << 17, **fields: Any
) -> SchedulerConfig:
    base = EngineConfig().scheduler_config(num_blocks, max_model_len, chunk_cost=None)
    return dataclasses.replace(base, **fields)
