#!/bin/bash
# One srun task of slurm/pipeline.sbatch or slurm/multinode.sbatch: a torchrun agent that starts GPUS ranks on
# its node and meets the other agents through c10d rendezvous at HEAD_ADDR:PORT. Usage (from the sbatch):
#   srun ... slurm/torchrun_task.sh launch/pipeline.py [flags...]
# with PYTHON, AGENTS, GPUS, HEAD_ADDR, PORT (and MAX_RESTARTS, default 0) exported by the batch script.
set -euo pipefail
: "${PYTHON:?} ${AGENTS:?} ${GPUS:?} ${HEAD_ADDR:?} ${PORT:?}"

# Task 0 (on the head node) hosts the rendezvous store, the others only connect. torch would guess this by
# comparing HEAD_ADDR with its own addresses, which misses addresses of secondary NICs (then no agent hosts the
# store and all of them time out) and cannot decide between two agents on one node.
is_host=0
[[ ${SLURM_PROCID:-0} == 0 ]] && is_host=1

# Slurm's preemption warning (SIGUSR1, see peerline_run_preemptible in common.sh) is for the ranks, which
# checkpoint and stop; torchrun would die of it. Ignored here, it stays ignored in torchrun (exec keeps it), and
# the ranks install their own handler.
trap '' USR1
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$AGENTS" --nproc_per_node="$GPUS" --max_restarts="${MAX_RESTARTS:-0}" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_ADDR:$PORT" --rdzv_id="${SLURM_JOB_ID:-0}" \
    --rdzv_conf="is_host=$is_host" \
    "$@"
