"""Where kernels/graph_memset.cu lives: the memset kernel distributed/cudagraph/memset_nodes.py puts into captured
graphs in place of small memset nodes (launched only from graph nodes, never from Python)."""

from __future__ import annotations

from pathlib import Path

KERNEL_SOURCE = Path(__file__).resolve().parent / "graph_memset.cu"
