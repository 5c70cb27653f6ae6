"""Plan: ops -> tile tasks -> static per-processor queues with dependency counters, buffer offsets
from tensor lifetimes, a versioned JSON format and a verifier (races, deadlocks).

    plan = megaloop.plan.make_plan(graph, processors=132, arch="sm_90")
    plan.ranks[0].processors    # each thread block's task list
"""

from megaloop.plan.build import make_plan
from megaloop.plan.model import Plan
from megaloop.plan.verify import verify_plan

__all__ = ["Plan", "make_plan", "verify_plan"]
