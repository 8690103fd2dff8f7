"""The choice lists of the run's configuration, each defined once.

A neutral module that imports nothing, so kernels/ (which must not import distributed/) and distributed/config.py
(which re-exports every list) share the same tuples; the command line takes its `choices=` from here too.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved", "zbv", "zb-interleaved")
#: --zb-memory: how many microbatches a zero-bubble stage may hold (pipeline/timed.py)
ZB_MEMORY = ("fast", "1f1b")
#: --zb-order: the rank orders of zbv and zb-interleaved (pipeline/order_search.py, pipeline/zbv_paper.py)
ZB_ORDERS = ("list", "searched", "paper")
#: --zb-order's default: zbv in the zero-bubble paper's order, the fastest measured on GPUs and at 1F1B's memory
#: (docs/TUNING.md); zb-interleaved has no paper order and runs its list order under it
DEFAULT_ZB_ORDER = "paper"
DTYPES = ("bf16", "fp32")
#: --precision: where the weights, gradients and AdamW state live (docs/PRECISION.md)
PRECISIONS = ("master", "autocast", "bf16", "compact")
DEVICES = ("auto", "cuda", "cpu")
KERNEL_IMPLEMENTATIONS = ("peerline", "torch")
KERNELS = ("auto", *KERNEL_IMPLEMENTATIONS)
P2P = ("auto", "copy-engine", "nccl")
GRAD_SYNCS = ("buckets", "per-param")
ALLREDUCE_PRIORITIES = ("highest", "normal")
ALLOCATORS = ("caching", "async")
STAGINGS = ("direct", "pinned")
DATA_SOURCES = ("seeded", "counter")
#: --data values besides a PATH or 'pkg.module:fn': the synthetic sources above and the default text corpus
TOKEN_DATA = ("text",)
MODELS = ("gpt",)  # built-in models besides the default residual MLP; --model also takes 'pkg.module:factory'
LOSSES = ("mse", "cross-entropy")  # --loss also takes 'pkg.module:fn'
RECOMPUTE = ("off", "full")  # --recompute also takes N: the first N layers of each stage

__all__ = ["SCHEDULES", "DTYPES", "PRECISIONS", "DEVICES", "KERNEL_IMPLEMENTATIONS", "KERNELS", "P2P", "GRAD_SYNCS",
           "ALLREDUCE_PRIORITIES", "ALLOCATORS", "STAGINGS", "DATA_SOURCES",
           "TOKEN_DATA", "MODELS", "LOSSES", "RECOMPUTE", "ZB_MEMORY", "ZB_ORDERS",
           "DEFAULT_ZB_ORDER"]
