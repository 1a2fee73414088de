"""MoE decode kernels: `route_plan` (top-k expert selection + the expert-sorted row plan in one launch),
`assigned` (the routed experts' GLU and down kernels reading the top-k ids directly, no plan) and `select` (the
router's sigmoid, biased top-k and combine weights in one launch, for those plan-free steps)."""

from pallas_kernels.moe.route_plan import BACKENDS, MAX_EXPERTS, MAX_TOKENS, RoutePlan, route_plan

__all__ = ["BACKENDS", "MAX_EXPERTS", "MAX_TOKENS", "RoutePlan", "route_plan"]
