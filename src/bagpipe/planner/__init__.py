"""The oracle's planner (pure) and the simple references it is tested against."""

from bagpipe.planner.plan import NEVER, POLICIES, PlannerConfig, PlanStep, plan, plan_spaces

__all__ = ["NEVER", "POLICIES", "PlanStep", "PlannerConfig", "plan", "plan_spaces"]
