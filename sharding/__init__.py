"""Mesh, logical-axis rules, expert and context parallelism."""
