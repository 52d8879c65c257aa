"""Pure-Python scheduler (standard library only): chunked prefill, microbatch planning, the
output-channel skip decision, and the ref-counted KV block pool."""

from .block_pool import BlockPool, BlockPoolError
from .chunking import ChunkCost
from .config import SKIP_MODES, SchedulerConfig
from .scheduler import Scheduler
from .skip import ReqInfo, decide_send, token_needed
from .state import SchedRequest, SchedulerInvariantError, TokenEvent

__all__ = [
    "SKIP_MODES",
    "BlockPool",
    "BlockPoolError",
    "ChunkCost",
    "ReqInfo",
    "SchedRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerInvariantError",
    "TokenEvent",
    "decide_send",
    "token_needed",
]
