"""MoE decode kernels: `assigned` (the routed experts' GLU and down kernels reading the top-k ids directly, no
expert-sorted plan) and `select` (the router's sigmoid, biased top-k and combine weights in one launch, for those
plan-free steps)."""
