"""The table "receives at the unit-time moment / just before the consumer" of this folder's README: each rank runs
its placed ZBV program (pp=2, M=8) in order with the one-H200 pass times of the twenty-first session; a receive from
the other rank stalls the rank where it is posted (the rendezvous form, what the copy engine ran before d22fbdf) or
just before its consumer (the ring form); a message arrives `transfer` ms after its producer ends.
Run from the repository root at d22fbdf or later: python docs/benchmarks/h200-x2/2026-11-29-session21/calls/program_play.py"""
from peerline.distributed.pipeline import order_search, rank_schedule
from peerline.distributed.pipeline.placement import V_SHAPE, Placement

PASSES = {"mlp": (7.183, 8.386, 5.946, 2.81), "gpt": (23.68, 28.95, 18.95, 8.72)}  # whole model: F, B, W, optimizer


def play(programs, placement: Placement, cost: dict[str, float], transfer: float) -> float:
    n, ready = placement.n_stages, {}
    pcs, clock = [0] * len(programs), [0.0] * len(programs)
    while any(pc < len(p) for pc, p in zip(pcs, programs)):
        moved = False
        for r, prog in enumerate(programs):
            while pcs[r] < len(prog):
                s, step = prog[pcs[r]]
                a = step[0]
                if a.op in ("F", "B", "W"):
                    st = a.stage if a.stage >= 0 else s
                    clock[r] += cost[a.op]
                    if a.op == "F" and st < n - 1 and placement.remote(st, st + 1):
                        ready[("RA", st + 1, a.mb)] = clock[r] + transfer
                    if a.op == "B" and st > 0 and placement.remote(st, st - 1):
                        ready[("RG", st - 1, a.mb)] = clock[r] + transfer
                else:
                    keys = [(x.op, x.stage, x.mb) for x in step if x.op in ("RA", "RG")
                            and placement.remote(x.stage, x.stage - 1 if x.op == "RA" else x.stage + 1)]
                    if any(k not in ready for k in keys):
                        break
                    clock[r] = max([clock[r], *(ready[k] for k in keys)])
                pcs[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the programs wait on each other")
    return max(clock)


placement = Placement(pp=2, per_rank=2, shape=V_SHAPE)
for model, (f, b, w, opt) in PASSES.items():
    cost = {"F": f / 4, "B": b / 4, "W": w / 4}
    for order in ("list", "searched", "paper"):
        orders = order_search.run_orders("zbv", placement, 8, "fast", order)
        forms = [play(rank_schedule.with_rank_messages(orders, placement, rendezvous=r), placement, cost, 0.05)
                 + opt / 2 for r in (True, False)]
        print(f"{model} {order}: at the unit-time moment {forms[0]:.1f} ms, just before the consumer {forms[1]:.1f}")
