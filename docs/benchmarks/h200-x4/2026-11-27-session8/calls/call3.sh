#!/usr/bin/env bash
# Device call 3 (4 GPUs). Phase 1, side by side: 0,1 the sharded optimizer at dp=2 (fp32 graph / eager, bf16 graph,
# with and without the overlapped gather) and the per-edge transport at two ranks; GPU 2 the kernel tests (pl_flat,
# the residual add's new one-pass kernel, against float64, poisoned outputs) then the kernels suite (graph-replayed
# device time against torch, 1 MiB - 1 GiB); GPU 3 the GPT block host-cost probe (launch shape, profiler table)
# then the async checkpoint test on one GPU. Phase 2, four GPUs: sharded at pp=2 x dp=2 (1F1B, ZB-H1; sharded and
# overlapped gather) and dp=4, the four-rank edge mix, resharding pp=2 -> pp=4 and pp=2 x dp=2 sharded -> pp=4.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/machine.txt 2>&1
sumup() { cp /tmp/$1/summary.txt $OUT/tests-$1.txt 2>/dev/null; cp /tmp/$1/w/runs/failures.txt $OUT/tests-$1-failures.txt 2>/dev/null; }
( export CUDA_VISIBLE_DEVICES=0,1
  OUT=/tmp/p01 LIMIT=250 TESTS="tests/gpu/test_shard_optimizer_gpu.py tests/gpu/test_edges_gpu.py" \
    bash tools/gpu_checks.sh -v -k "dp2_sharded or dp2_overlapped or two_ranks" > /dev/null 2>&1; sumup p01 ) &
sleep 10
( export CUDA_VISIBLE_DEVICES=2
  OUT=/tmp/g2 LIMIT=150 TESTS="tests/gpu/test_kernels_elementwise.py tests/gpu/test_kernels_launch_path.py" \
    bash tools/gpu_checks.sh -v > /dev/null 2>&1; sumup g2
  t0=$SECONDS
  timeout -k 5 $((255 - SECONDS)) python3 -m peerline.bench.suites.kernels --sizes-mib 1,4,16,64,256,1024 --out /tmp/b/kernels > /tmp/b-kernels.log 2>&1
  echo "kernels rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" > $OUT/kernels.md
  cat /tmp/b/kernels/results.md >> $OUT/kernels.md 2>/dev/null; cp /tmp/b/kernels/results.jsonl $OUT/kernels.jsonl 2>/dev/null
  grep -E "GOAL|Error|error" /tmp/b-kernels.log | tail -n 40 >> $OUT/kernels.md ) &
sleep 10
( export CUDA_VISIBLE_DEVICES=3
  t0=$SECONDS
  timeout -k 5 100 python3 tools/gpu_probes/gpt_block_host_probe.py --profile > $OUT/gpt-block-host-probe.txt 2>&1
  echo "probe rc=$? in $((SECONDS - t0)) s (load $(cut -d' ' -f1 /proc/loadavg))" >> $OUT/gpt-block-host-probe.txt
  OUT=/tmp/g3 LIMIT=$((250 - SECONDS)) TESTS="tests/gpu/test_checkpoint_async_gpu.py" bash tools/gpu_checks.sh -v -k one_gpu > /dev/null 2>&1; sumup g3 ) &
wait
echo "phase 2 at $SECONDS s" >> $OUT/machine.txt
OUT=/tmp/p4 LIMIT=$((545 - SECONDS)) TESTS="tests/gpu/test_shard_optimizer_gpu.py tests/gpu/test_edges_gpu.py tests/gpu/test_checkpoint_reshard_gpu.py" \
  bash tools/gpu_checks.sh -v -k "(pp2_dp2 or dp4 or four_ranks or pp2-pp4 or pp2dp2s-pp4) and not pp4-dp4s" > /dev/null 2>&1; sumup p4
echo "done at $SECONDS s" >> $OUT/machine.txt
