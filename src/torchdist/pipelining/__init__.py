"""``torchdist.pipelining``: PyTorch's ``torch.distributed.pipelining`` (pipeline parallelism) on torchdist.

Modules: ``microbatch`` (splitting batches, merging outputs), ``stage``
(``PipelineStage``: a piece of the model and its forward/backward of one
microbatch), ``schedules`` (the order of forwards and backwards, and the step),
``_plans`` (those orders as per-rank action lists), ``_actions`` (the action IR:
checks, lowering to SEND/RECV, CSV files), ``_executor`` (runs a rank's actions), ``_comm`` (how stages talk),
``_meta`` (the tensor metadata stages agree on), ``_ir`` (the fx tracer front end).
"""

from ._ir import Pipe, SplitPoint, pipe_split, pipeline
from ._meta import PipeliningMetadataError
from .schedules import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                        ScheduleInterleavedZeroBubble, ScheduleLoopedBFS, ScheduleZBVZeroBubble, get_schedule_class)
from .stage import PipelineStage, build_stage

__all__ = [
    "Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage", "build_stage",
    "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
    "PipeliningMetadataError", "get_schedule_class",
]
