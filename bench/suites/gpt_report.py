"""The records and notes of the gpt suite: tokens/s and MFU of each peerline variant, and of peerline's GPT under torch
(the `torch-peerline-gpt` row), against the fastest anchor candidate (the plain torch GPT), the candidates' times,
the recompute table (ms/iter and peak memory of each setting against off), and the one-GPU row (--gpt-single:
peerline --stages 1 --no-graph --precision bf16 against the whole plain torch GPT eager, pp 1). Every record's extra
names its model ("model") and the anchor's ("anchor_model"), schedule, recipe and blocks.

Achieved TFLOP/s are per GPU: the model FLOPs of an iteration (models/flops.py gpt_flops_per_token x tokens,
recomputation not counted, as MFU is defined) over the iteration time and the pp ranks; MFU divides them by the
card's dense bf16 peak (models/flops.py peak_bf16_tflops; not reported for a card not in its table or the CPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from peerline.bench.benchkit import BenchContext, Record
from peerline.bench.runtime_timing import Measured
from peerline.bench.suites.gpt_anchor import MODELS, GPTShape
from peerline.bench.suites.torch_schedules import candidate_name, candidate_times, host_lead
from peerline.distributed.memory.state_bytes import describe_split
from peerline.models.flops import gpt_flops_per_token, peak_bf16_tflops

SUITE = "gpt"
#: goals: peerline graph vs the fastest torch.distributed.pipelining candidate, tokens/s
#: issue 30, at pp >= 2 (a pipeline against torch's): >= 1.15x the anchor; launch-bound kept >= 4x
GOALS = {"compute-bound": 1.15, "launch-bound": 4.0}
#: the one-GPU row (--gpt-single): peerline's flags and its anchor
ONE_GPU_FLAGS = "--stages 1 --no-graph --precision bf16"
ONE_GPU_ANCHOR = "plain torch GPT eager, one GPU"


def card_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak of this rank's card, TFLOP/s (None on the CPU or a card not in the table)."""
    if device.type != "cuda":
        return None
    return peak_bf16_tflops(torch.cuda.get_device_name(device))


class GPTReport:
    """Writes one shape's records into the context as its measurements arrive."""

    def __init__(self, ctx: BenchContext, shape: GPTShape, vocab: int, pp: int) -> None:
        self.ctx, self.shape, self.vocab, self.pp = ctx, shape, vocab, pp
        self.tokens = shape.microbatches * shape.micro_batch_size * shape.seq
        self.flops_per_token = gpt_flops_per_token(vocab=vocab, hidden=shape.hidden, layers=shape.layers,
                                                   seq=shape.seq)
        self.peak_tflops = card_peak_tflops(ctx.device)

    @property
    def sizes(self) -> dict[str, Any]:
        return {**self.shape.sizes(), "pp": self.pp, "vocab": self.vocab, "tokens_per_iter": self.tokens}

    def metrics(self, m: Measured) -> dict[str, Any]:
        """ms/iter, tokens/s, TFLOP/s per GPU, MFU % (None when the peak is unknown), peak memory by rank."""
        ms = m.timing.median_ms
        tflops = self.flops_per_token * self.tokens / (ms / 1e3) / self.pp / 1e12
        mfu = 100.0 * tflops / self.peak_tflops if self.peak_tflops else None
        return {"ms_per_iter": ms, "tokens_per_s": m.tokens_per_s(self.tokens), "tflops": tflops, "mfu": mfu,
                "spread": m.timing.spread, "host_lead_ms": m.timing.host_lead_ms,
                "peak_mem_gb_per_rank": m.peak_gb_per_rank, "losses": m.losses}

    def describe(self, m: Measured) -> str:
        got = self.metrics(m)
        mfu = f", MFU {got['mfu']:.1f}%" if got["mfu"] is not None else ""
        mem = f", peak {max(m.peak_gb_per_rank):.1f} GiB" if m.peak_gb_per_rank else ""
        split = describe_split(m.extra.get("state_bytes") or {}, m.peak_gb_per_rank or [])
        return f"{got['ms_per_iter']:.2f} ms/iter{host_lead(m.timing)}, {got['tflops']:.3g} TFLOP/s per GPU{mfu}" \
            f"{mem}" + (f" ({split})" if split else "")

    def candidates(self, measured: dict[str, Measured], best: Measured) -> None:
        """One note: every candidate's time of one model under torch and the one that won."""
        self.ctx.note(f"gpt {self.shape.name} pp={self.pp}: torch.distributed.pipelining candidates, "
                      f"{best.extra['model']} (ms/iter): {candidate_times(measured)}; fastest: "
                      f"{candidate_name(measured, best)} ({self.describe(best)})")

    def variant(self, m: Measured, anchor: Measured | None) -> None:
        """A peerline variant against the anchor: tokens/s (and MFU %), and the goal line for graphs on GPUs."""
        if anchor is None or m is anchor:
            return
        a = anchor.extra
        name = f"torch.distributed.pipelining {a['model']} {a['schedule']} {a['recipe']} {a['blocks']}"
        mine, theirs = self.metrics(m), self.metrics(anchor)
        diff = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(m.losses, anchor.losses, strict=False)),
                   default=math.nan)
        extra = {**mine, **{f"anchor_{k}": v for k, v in theirs.items()}, "max_loss_rel_diff": diff,
                 "anchor_model": a["model"], "anchor_schedule": a["schedule"], "anchor_recipe": a["recipe"],
                 "anchor_blocks": a["blocks"], "anchor_candidates": a.get("candidates", {}),
                 "anchor_state_bytes": a.get("state_bytes"), **m.extra}
        case = f"{self.shape.name} {m.name}"
        rec = self.ctx.record(Record(SUITE, case, "tokens/s", mine["tokens_per_s"], theirs["tokens_per_s"], name,
                                     sizes=self.sizes, extra=extra))
        if mine["mfu"] is not None:
            self.ctx.record(Record(SUITE, f"{case} MFU", "MFU %", mine["mfu"], theirs["mfu"], name,
                                   sizes=self.sizes))
        paired = (f"; the anchor taken in turn with it {theirs['ms_per_iter']:.2f} ms/iter (in its search "
                  f"{m.extra['anchor_search_ms']:.2f})" if m.extra.get("anchor_paired") else "")
        self.ctx.note(f"gpt {case} pp={self.pp}: {self.describe(m)}{paired}")
        goal = GOALS.get(self.shape.name)
        if goal is not None and m.name.startswith("graph") and self.ctx.device.type == "cuda" and self.pp > 1:
            self.ctx.note(f"GOAL {'MET' if rec.ratio >= goal else 'MISSED'} gpt {self.shape.name} pp={self.pp}: "
                          f"{m.name} {rec.ratio:.2f}x torch (goal >= {goal}x); {self.describe(m)}")

    def one_gpu(self, m: Measured, plain: Measured) -> None:
        """The one-GPU row (--gpt-single; pp 1): peerline ONE_GPU_FLAGS against the whole plain torch GPT eager with
        bf16 parameters, tokens/s; both sides' ms/iter and first losses in the note."""
        mine, theirs = self.metrics(m), self.metrics(plain)
        extra = {**mine, **{f"anchor_{k}": v for k, v in theirs.items()}, "model": "peerline's GPT",
                 "flags": ONE_GPU_FLAGS, "anchor_model": MODELS["plain"], "anchor_recipe": "bf16",
                 "anchor_blocks": "eager"}
        case = f"{self.shape.name} {m.name}"
        rec = self.ctx.record(Record(SUITE, case, "tokens/s", mine["tokens_per_s"], theirs["tokens_per_s"],
                                     ONE_GPU_ANCHOR, sizes=self.sizes, extra=extra))
        self.ctx.note(f"gpt {case}: peerline {ONE_GPU_FLAGS} {self.describe(m)}, losses {_losses(m)}; "
                      f"{ONE_GPU_ANCHOR} {self.describe(plain)}, losses {_losses(plain)}; {rec.ratio:.2f}x")

    def recompute(self, m: Measured, off: Measured) -> None:
        """One setting of the recompute table: ms/iter against off, and (on GPUs) peak memory against off."""
        setting = m.extra["recompute"]
        saved = [a - b for a, b in zip(off.peak_gb_per_rank, m.peak_gb_per_rank, strict=False)]
        extra = {"ms_per_iter": m.timing.median_ms, "off_ms_per_iter": off.timing.median_ms,
                 "time_paid_pct": 100.0 * (m.timing.median_ms / off.timing.median_ms - 1.0),
                 "peak_mem_gb_per_rank": m.peak_gb_per_rank, "off_peak_mem_gb_per_rank": off.peak_gb_per_rank,
                 "saved_gb_per_rank": saved, "losses": m.losses, "off_losses": off.losses, "variant": m.name}
        case = f"{self.shape.name} recompute {setting}"
        anchor_name = f"peerline {m.name} --recompute off"
        self.ctx.record(Record(SUITE, f"{case} time", "ms/iter", m.timing.median_ms, off.timing.median_ms,
                               anchor_name, higher_is_better=False, sizes=self.sizes, extra=extra))
        if m.peak_gb_per_rank and off.peak_gb_per_rank:
            self.ctx.record(Record(SUITE, f"{case} peak memory", "GiB (max rank)", m.peak_gb, off.peak_gb,
                                   anchor_name, higher_is_better=False, sizes=self.sizes, extra=extra))
        memory = (f"peak memory saved per rank: {', '.join(f'{v:.2f}' for v in saved)} GiB" if saved
                  else "no device memory to compare on the CPU")
        self.ctx.note(f"gpt {case}: {extra['time_paid_pct']:+.1f}% time against off; {memory}")


def _losses(m: Measured) -> str:
    return ", ".join(f"{v:.6g}" for v in m.losses)
