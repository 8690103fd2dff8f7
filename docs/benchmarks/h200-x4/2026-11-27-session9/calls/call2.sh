#!/usr/bin/env bash
# Device call 2 (4 GPUs). Phase 1 side by side: GPU 0 the GPU tests of the launch-path change (RoPE, LayerNorm,
# compact AdamW, the counter data, the GPT one-GPU runs); GPU 1 the GPT block host probe --rope-parts; GPUs 2,3 the
# MLP pipeline bench at pp=2 M=8, zbv and interleaved graph against torch 1F1B. Phase 2 alone: the eager GPT bench
# at pp=2 (launch, compute). Phase 3, 4 GPUs: the MLP pipeline bench at pp=4 M=8, zbv graph.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > $OUT/machine.txt 2>&1
B=/tmp/b; mkdir -p $B
( export CUDA_VISIBLE_DEVICES=0
  OUT=/tmp/g0 LIMIT=230 TESTS="tests/gpu/test_rope_gpu.py tests/gpu/test_layer_norm_gpu.py tests/gpu/test_compact_adamw_gpu.py tests/gpu/test_graph_loop_gpu.py tests/gpu/test_gpt_gpu.py" \
    bash tools/gpu_checks.sh -v > /dev/null 2>&1
  cp /tmp/g0/summary.txt $B/tests-g0.txt; cp /tmp/g0/w/runs/failures.txt $B/tests-g0-failures.txt 2>/dev/null
  echo "tests g0 done at $SECONDS s" >> $OUT/machine.txt ) &
sleep 8
( export CUDA_VISIBLE_DEVICES=1
  timeout -k 5 150 python3 tools/gpu_probes/gpt_block_host_probe.py --rope-parts > $B/probe.txt 2>&1
  echo "probe rc=$? at $SECONDS s" >> $B/probe.txt ) &
sleep 8
( export CUDA_VISIBLE_DEVICES=2,3
  timeout -k 10 220 torchrun --standalone --nproc_per_node=2 launch/bench.py pipeline --pipeline-configs compute \
    --schedules zbv,interleaved --variants torch,graph --pipeline-anchor-schedules 1f1b \
    --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --out $B/pp2 > $B/pp2.log 2>&1
  echo "pp2 rc=$? at $SECONDS s" >> $B/pp2.log ) &
wait
echo "phase 2 at $SECONDS s, GPU processes: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" >> $OUT/machine.txt
CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 160 torchrun --standalone --nproc_per_node=2 launch/bench.py gpt --gpt-configs compute,launch \
  --gpt-variants torch,eager --gpt-precisions bf16 --gpt-anchor-compile off --gpt-anchor-schedules 1f1b --reps 3 --warmup 1 \
  --out $B/gpt-eager > $B/gpt-eager.log 2>&1
echo "gpt-eager rc=$? at $SECONDS s" >> $B/gpt-eager.log
echo "phase 3 at $SECONDS s" >> $OUT/machine.txt
timeout -k 10 $((560 - SECONDS)) torchrun --standalone --nproc_per_node=4 launch/bench.py pipeline --pipeline-configs compute \
  --schedules zbv --variants torch,graph --pipeline-anchor-schedules 1f1b \
  --pipeline-anchor-recipes bf16-params --reps 3 --warmup 1 --out $B/pp4 > $B/pp4.log 2>&1
echo "pp4 rc=$? at $SECONDS s" >> $B/pp4.log
cp $B/probe.txt $B/tests-g0.txt $OUT/ 2>/dev/null
{ for r in gpt-eager pp2 pp4; do echo "=== $r"; cat $B/$r/results.md 2>/dev/null; done; } > $OUT/results.md
tar -czf $OUT/bench.tgz -C $B --exclude='*.pt' . 2>/dev/null
echo "done at $SECONDS s" >> $OUT/machine.txt
