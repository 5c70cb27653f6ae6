"""Plan: ops -> tile tasks -> static per-processor queues with dependency counters, buffer offsets
from tensor lifetimes, a versioned JSON format and a verifier (races, deadlocks).

    plan = megaloop.plan.make_plan(graph, processors=132, arch="sm_90")
    plan.ranks[0].processors    # each thread block's task list
"""

from megaloop.fuse import FuseOptions
from megaloop.plan import format as _format
from megaloop.plan.build import make_plan
from megaloop.plan.model import CONVENIENCES as _CONVENIENCES
from megaloop.plan.model import KernelOptions, Plan
from megaloop.plan.stats import plan_stats as _plan_stats
from megaloop.plan.verify import verify_plan

# plan.save(), Plan.load(), plan.verify(), plan.stats()
vars(_CONVENIENCES).update(save=_format.save, load=_format.load, verify=verify_plan, stats=_plan_stats)

__all__ = ["FuseOptions", "KernelOptions", "Plan", "make_plan", "verify_plan"]
