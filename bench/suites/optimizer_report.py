"""The records and notes of the optimizer suite (bench/suites/optimizer.py) for one model and configuration: the
table (one note per row: ms/iter, tokens/s, optimizer state per rank, peak memory), each sharded step against the
unsharded one and against every torch row (ms/iter; extra: every row's figures as `<row>_<figure>`), the optimizer
state per rank, and the GOAL and RATIO lines.
"""

from __future__ import annotations

from typing import Any

from peerline.bench.benchkit import BenchContext, Record

SUITE = "optimizer"
#: row -> what it is (the records' anchor names)
ROWS = {
    "ddp": "torch DDP + AdamW (fused)",
    "ddp-zero": "torch DDP + ZeroRedundancyOptimizer(AdamW, fused)",
    "zero": "torch.distributed.pipelining 1F1B + DDP + ZeroRedundancyOptimizer",
    "allreduce": "peerline bucketed all-reduce, unsharded AdamW",
    "sharded": "peerline --shard-optimizer",
    "overlap": "peerline --shard-optimizer --overlap-param-gather",
}
#: the rows each sharded step is compared with, in order; the torch rows by their short names in the RATIO line
BASES = ("allreduce", "ddp", "ddp-zero", "zero")
SHORT = {"ddp": "DDP", "ddp-zero": "DDP + ZeRO", "zero": "pipelining + DDP + ZeRO"}
SHARDED_ROWS = ("sharded", "overlap")
#: goals on GPUs: sharded step time / all-reduce step time at most this; state per rank at most (1/dp) x this
STEP_GOAL, MEMORY_SLACK = 1.03, 1.1


def _size(n: int) -> str:
    """Bytes in KiB, MiB or GiB."""
    unit = next((u for u in ("GiB", "MiB") if n >= 2 ** {"GiB": 30, "MiB": 20}[u]), "KiB")
    return f"{n / 2 ** {'GiB': 30, 'MiB': 20, 'KiB': 10}[unit]:.2f} {unit}"


class OptimizerReport:
    """Writes one OptimizerBench's records and notes into the context from its rows' figures."""

    def __init__(self, ctx: BenchContext, bench: Any) -> None:
        self.ctx, self.bench, self.grid = ctx, bench, bench.grid
        self.sizes = {**bench.shape.sizes(), "model": bench.model, "pp": bench.pp, "dp": bench.dp,
                      "tokens_per_iter": bench.tokens}

    def write(self, results: dict[str, dict[str, Any]]) -> None:
        extra = {f"{name}_{key}": value for name, r in results.items() for key, value in r.items()}
        for variant, figures in results.items():
            self.row(variant, figures)
        for variant in SHARDED_ROWS:
            if variant in results:
                self.steps(variant, results, extra)
        self.state(results, extra)

    def row(self, variant: str, r: dict[str, Any]) -> None:
        """One line of the table."""
        model = "plain torch " + self.bench.model.upper() if variant in SHORT else "peerline " + self.bench.model
        peak = f", peak {r['peak_gb']:.1f} GiB" if r.get("peak_gb") else ""
        self.ctx.note(f"optimizer {self.grid} row {variant}: {r['ms']:.2f} ms/iter, {r['tokens_per_s']:,.0f} "
                      f"tokens/s, optimizer state {_size(max(r['state_bytes']))} per rank (max; by rank "
                      f"{', '.join(_size(b) for b in r['state_bytes'])}){peak}; {ROWS[variant]}, "
                      f"{model}, {r['grid']}")

    def _same_weights(self, base: str) -> bool:
        """Whether the row starts from peerline's weights (the plain GPT has its own init)."""
        return self.bench.model == "mlp" or base not in SHORT

    def steps(self, variant: str, results: dict[str, dict[str, Any]], extra: dict[str, Any]) -> None:
        """A sharded step against the unsharded one (its GOAL line on GPUs) and every torch row (a RATIO line)."""
        mine, on_gpu, ratios = results[variant], self.ctx.device.type == "cuda", []
        for base in (b for b in BASES if b in results):
            theirs = results[base]
            diff = (max((abs(a - b) for a, b in zip(mine["losses"], theirs["losses"], strict=False)), default=None)
                    if self._same_weights(base) else None)
            rec = self.ctx.record(Record(SUITE, f"{self.grid} {variant} vs {base}", "ms/iter", mine["ms"],
                                         theirs["ms"], ROWS[base], higher_is_better=False, sizes=self.sizes,
                                         extra={**extra, "max_loss_diff": diff}))
            if base == "allreduce" and on_gpu:
                met = rec.ratio >= 1 / STEP_GOAL
                self.ctx.note(f"GOAL {'MET' if met else 'MISSED'} optimizer {self.grid}: {variant} step "
                              f"{rec.ratio:.3f}x allreduce (goal >= {1 / STEP_GOAL:.3f}x: within 3%)")
            elif base in SHORT:
                faster = variant if rec.ratio >= 1 else SHORT[base]
                ratios.append(f"{SHORT[base]} {rec.ratio:.3f}x ({faster} faster)")
        if ratios:
            self.ctx.note(f"RATIO optimizer {self.grid}: {variant} step against torch (its ms/iter over "
                          f"{variant}'s): " + ", ".join(ratios))

    def state(self, results: dict[str, dict[str, Any]], extra: dict[str, Any]) -> None:
        """The optimizer state per rank, sharded (or overlap) against allreduce, and its GOAL line."""
        variant = next((v for v in SHARDED_ROWS if v in results), None)
        base = results.get("allreduce")
        if variant is None or base is None:
            return
        dp = self.bench.dp
        rec = self.ctx.record(Record(SUITE, f"{self.grid} optimizer state per rank", "bytes",
                                     max(results[variant]["state_bytes"]), max(base["state_bytes"]),
                                     "unsharded AdamW (peerline)", higher_is_better=False, sizes=self.sizes,
                                     extra={**extra, "sharded_row": variant}))
        met = rec.ratio >= dp / MEMORY_SLACK
        self.ctx.note(f"GOAL {'MET' if met else 'MISSED'} optimizer {self.grid}: {variant} state per rank "
                      f"1/{rec.ratio:.2f} of unsharded (goal <= {MEMORY_SLACK}/{dp})")
