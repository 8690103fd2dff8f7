# Shared by slurm/*.sbatch (sourced, never run): find python, resolve the device and the grid, find the head node.
# Every failure prints one line `peerline: error: <what to do>` and exits 2, like the harness itself.
# shellcheck shell=bash

peerline_die() {
    echo "peerline: error: $*" >&2
    exit 2
}

# Positive integer check for sizes that come from the environment.
peerline_require_int() {  # name value
    [[ $2 =~ ^[1-9][0-9]*$ ]] || peerline_die "$1=$2 is not a positive integer"
}

# The repository: PEERLINE_REPO, else the submit directory (or its parent when submitted from slurm/).
# Slurm runs a copy of the batch script from its spool directory, so the script's own path says nothing.
peerline_find_repo() {
    local candidate
    if [[ -n ${PEERLINE_REPO:-} && ! -f $PEERLINE_REPO/launch/pipeline.py ]]; then
        peerline_die "PEERLINE_REPO=$PEERLINE_REPO has no launch/pipeline.py"
    fi
    for candidate in "${PEERLINE_REPO:-}" "${SLURM_SUBMIT_DIR:-$PWD}" "$(dirname "${SLURM_SUBMIT_DIR:-$PWD}")"; do
        if [[ -n $candidate && -f $candidate/launch/pipeline.py ]]; then
            REPO=$(cd "$candidate" && pwd)
            ENTRY=$REPO/launch/pipeline.py
            return 0
        fi
    done
    peerline_die "cannot find launch/pipeline.py: submit from the peerline checkout or set PEERLINE_REPO"
}

# A python that can import peerline and torch: PEERLINE_PYTHON, the active virtualenv, the repo's .venv, PATH.
# torch is looked up, not imported: importing it takes seconds, and every rank imports it anyway.
PEERLINE_IMPORT_CHECK='import importlib.util, peerline; assert importlib.util.find_spec("torch")'
peerline_find_python() {
    local candidate
    if [[ -n ${PEERLINE_PYTHON:-} ]]; then
        "$PEERLINE_PYTHON" -c "$PEERLINE_IMPORT_CHECK" >/dev/null 2>&1 \
            || peerline_die "PEERLINE_PYTHON=$PEERLINE_PYTHON cannot import peerline and torch"
        PYTHON=$PEERLINE_PYTHON
        return 0
    fi
    for candidate in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$REPO/.venv/bin/python" python3 python; do
        [[ -n $candidate ]] && command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c "$PEERLINE_IMPORT_CHECK" >/dev/null 2>&1; then
            PYTHON=$(command -v "$candidate")
            return 0
        fi
    done
    peerline_die "no python here imports peerline and torch: pip install -e $REPO, or set PEERLINE_PYTHON"
}

# DEVICE (cpu | cuda | auto, from PEERLINE_DEVICE, which launch/pipeline.py also reads as its --device default)
# and GPUS, the number of ranks per torchrun agent: the GPUS variable if set, 2 on the CPU, else the GPUs
# Slurm gave this node.
peerline_resolve_device() {
    DEVICE=${PEERLINE_DEVICE:-auto}
    case $DEVICE in
        cpu | cuda | auto) ;;
        *) peerline_die "PEERLINE_DEVICE=$DEVICE: expected cpu, cuda or auto" ;;
    esac
    if [[ -n ${GPUS:-} ]]; then
        peerline_require_int GPUS "$GPUS"
    elif [[ $DEVICE == cpu ]]; then
        GPUS=2
    elif [[ -n ${SLURM_GPUS_ON_NODE:-} && ${SLURM_GPUS_ON_NODE} != 0 ]]; then
        GPUS=$SLURM_GPUS_ON_NODE
    elif [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != NoDevFiles ]]; then
        GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        GPUS=$(nvidia-smi -L | grep -c '^GPU')
    else
        peerline_die "no GPUs in this allocation: ask with sbatch --gpus-per-node=N, or run on the CPU with" \
            "PEERLINE_DEVICE=cpu sbatch --gpus-per-node=0 ..."
    fi
    [[ $GPUS -ge 1 ]] || peerline_die "no GPUs found on $(hostname -s)"
}

# HEAD_NODE (first host of the allocation, as `scontrol show hostnames` lists it) and HEAD_ADDR (its IPv4
# address as the head node itself reports it, so nothing depends on name lookup on the other nodes).
# PEERLINE_HEAD_ADDR overrides the address (e.g. the address of a fast network the nodes share).
peerline_find_head() {
    # awk, not head: head would exit early and fail the pipe (SIGPIPE under pipefail) on long node lists.
    HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | awk 'NR == 1' || true)
    [[ -n $HEAD_NODE ]] \
        || peerline_die "scontrol show hostnames '${SLURM_JOB_NODELIST:-}' printed nothing (not in a Slurm job?)"
    if [[ -n ${PEERLINE_HEAD_ADDR:-} ]]; then
        HEAD_ADDR=$PEERLINE_HEAD_ADDR
        return 0
    fi
    # --overlap: this tiny step may share the CPUs that the training step will use later.
    HEAD_ADDR=$(srun --nodes=1 --ntasks=1 --overlap --nodelist="$HEAD_NODE" hostname --ip-address 2>/dev/null \
        | tr ' ' '\n' | grep -m 1 -E '^[0-9]+(\.[0-9]+){3}$' || true)
    # Debian maps the own host name to 127.0.1.1 in /etc/hosts: unreachable from other nodes, so then take the
    # head node's first global address instead (hostname --all-ip-addresses lists no loopback address).
    if [[ -z $HEAD_ADDR || ($HEAD_ADDR == 127.* && ${SLURM_NNODES:-1} -gt 1) ]]; then
        HEAD_ADDR=$(srun --nodes=1 --ntasks=1 --overlap --nodelist="$HEAD_NODE" hostname --all-ip-addresses \
            2>/dev/null | tr ' ' '\n' | grep -m 1 -E '^[0-9]+(\.[0-9]+){3}$' || true)
    fi
    [[ -n $HEAD_ADDR ]] || peerline_die "cannot find an IPv4 address of head node $HEAD_NODE; set PEERLINE_HEAD_ADDR"
}

# The rendezvous port: the same formula as distributed/env.py (slurm_port), so every task agrees without
# talking and two jobs sharing a node differ. MASTER_PORT overrides.
peerline_port() {
    PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
    peerline_require_int MASTER_PORT "$PORT"
}

# One line with the resolved grid at the top of the job log; pp/dp as given on the command line, if given.
peerline_print_grid() {  # launcher nodes ranks_per_node world args...
    local launcher=$1 nodes=$2 per_node=$3 world=$4 pp="(default)" dp="(default)"
    shift 4
    local prev=""
    for arg in "$@"; do
        case $prev in --pp) pp=$arg ;; --dp) dp=$arg ;; esac
        case $arg in --pp=*) pp=${arg#--pp=} ;; --dp=*) dp=${arg#--dp=} ;; esac
        prev=$arg
    done
    echo "peerline-slurm: job=${SLURM_JOB_ID:-none} launcher=$launcher nodes=$nodes (${SLURM_JOB_NODELIST:-?})" \
        "ranks_per_node=$per_node world=$world pp=$pp dp=$dp device=$DEVICE head=${HEAD_NODE:-?}" \
        "addr=${HEAD_ADDR:-?}:${PORT:-?}"
    echo "peerline-slurm: repo=$REPO python=$PYTHON args: $*"
}

# Preemption: run the job step (srun ...) in the background so this shell can take Slurm's warning signal
# (`#SBATCH --signal=B:USR1@120`: SIGUSR1 to the batch shell 120 s before the time limit, or
# `scancel --batch --signal=USR1 JOB`). The shell forwards it to the step's ranks (`scancel --signal=USR1`:
# torchrun agents ignore it, see torchrun_task.sh), which stop at one iteration boundary, write their checkpoint
# (--save DIR) and exit 75. A preempted step (the signal came, or a rank exited 75) requeues the job
# (`#SBATCH --requeue`), which continues with --resume DIR. Sets `rc` to the step's exit code.
peerline_run_preemptible() {  # command...
    PEERLINE_PREEMPTED=0
    trap 'PEERLINE_PREEMPTED=1; echo "peerline-slurm: job=${SLURM_JOB_ID:-none} got SIGUSR1: the ranks checkpoint and stop"; scancel --signal=USR1 "${SLURM_JOB_ID}"' USR1
    "$@" &
    local pid=$!
    while :; do
        wait "$pid"
        rc=$?
        # wait returns >128 when the trap interrupted it; the step may still be running
        if (( rc > 128 )) && kill -0 "$pid" 2>/dev/null; then continue; fi
        break
    done
    if (( rc > 128 )); then  # interrupted, and the step ended meanwhile: its own status
        wait "$pid" 2>/dev/null
        local again=$?
        (( again != 127 )) && rc=$again
    fi
    trap - USR1
    if [[ $PEERLINE_PREEMPTED == 1 || $rc == 75 ]]; then
        echo "peerline-slurm: job=${SLURM_JOB_ID:-none} preempted (exit code $rc): requeued, it continues with --resume"
        scontrol requeue "${SLURM_JOB_ID}" \
            || echo "peerline-slurm: scontrol requeue failed: resubmit with --resume DIR" >&2
        rc=75
    fi
}
