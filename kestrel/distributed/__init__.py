"""Ranks and collectives: the process groups of tensor- and pipeline-parallel workers
(`parallel_state`) and how a machine's CPU cores are split between ranks (`cpu_binding`).

A process that never initialises a world runs as rank 0 of a world of one: every group exists, has
one member, and its collectives return their input, so single-worker code calls them unconditionally.
"""

from kestrel.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
)

__all__ = ["GroupCoordinator", "destroy_distributed_environment", "get_pp_group", "get_tp_group",
           "init_distributed_environment"]
