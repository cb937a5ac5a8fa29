"""Routing requests across workers: the router, its approximate tree, and clusters.

``Router`` chooses a worker per request (``POLICIES``); ``ApproxTree`` is its memory of
which prefixes went where; ``simulate_cluster`` serves a workload on N simulated GPUs and
``serve_cluster`` on N real CityLM engines, both on one event clock (``ClusterResult``).
"""

from minisrv.router.cluster import ClusterResult, run_cluster, serve_cluster, simulate_cluster
from minisrv.router.policy import BRANCHES, LAUNCHER_DEFAULTS, POLICIES, Router
from minisrv.router.tree import ApproxTree, TreeMatch, common_prefix_length

__all__ = [
    "ApproxTree",
    "BRANCHES",
    "ClusterResult",
    "LAUNCHER_DEFAULTS",
    "POLICIES",
    "Router",
    "TreeMatch",
    "common_prefix_length",
    "run_cluster",
    "serve_cluster",
    "simulate_cluster",
]
