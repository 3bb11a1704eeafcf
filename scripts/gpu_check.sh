#!/usr/bin/env bash
# One-GPU check, under 5 minutes on an H100/H200: the gpt-1b config (1.42B parameters, bf16
# compute, float32 master weights and Adam state) for a few dozen steps on synthetic tokens,
# printing tokens/s, MFU and peak memory; then `jaxmp bench --devices 1` of the same model,
# which puts the compiled memory and the measured step beside the planner's prediction.
#
#   scripts/gpu_check.sh                      # defaults below
#   STEPS=60 BATCH=16 REMAT=full scripts/gpu_check.sh
#   scripts/gpu_check.sh --set model.layers=12          # extra --set go to both commands
#   GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh --set model.layers=2 --set model.d_model=64 \
#       --set model.heads=4 --set model.vocab_size=512 --set data.seq_len=64   # dry run on CPU
#   scripts/gpu_check.sh --aot                # no GPU: compile the same step for a deviceless
#                                             # H100 (KIND=H200 ...) here, with XLA's GPU compiler
#
# --aot runs `jaxmp plan --devices 1 --device-kind $KIND --verify --aot` on the very settings
# below (needs JAX's CUDA plugin: pip install -e ".[cuda]"): the GPU program is compiled on this
# machine, its peak memory, fit and collectives printed beside the planner's prediction, so on
# the first lent GPU only the timing remains unknown.
#
# XLA flags: the config's [xla].flags (latency-hiding scheduler, pipelined and combined
# collectives, double-buffered layer loop); they matter once there are several GPUs and are
# harmless on one. Memory: JAX may take 90 % of the GPU (default 75 %); remat "save_dots" at
# batch 8 x 2048 is predicted at 37.4 GiB per device and compiles (--aot, H100, jax 0.10.2) to
# 38.8 GiB; if it runs out of memory, REMAT=full. First real run (one H200, jax 0.11.2,
# 2026-12-04, docs/benchmarks.md): 56,234 tokens/s, MFU 51.8 %, 291 ms/step, peak 38.95 GiB.
set -euo pipefail

CONFIG=${CONFIG:-jaxmp/configs/gpt-1b.toml}
STEPS=${STEPS:-40}            # logged every 5; the first 5 (compile, warm-up) are not counted
BATCH=${BATCH:-8}             # sequences of 2048 tokens: 16k tokens per step
REMAT=${REMAT:-save_dots}     # gpt-1b.toml says "auto" (the planner's choice); fixed here
OUT=${OUT:-runs/gpu_check}
KIND=${KIND:-H100}            # --aot: the deviceless GPU to compile for
AOT=
if [[ ${1:-} == --aot ]]; then AOT=1; shift; fi
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}          # one GPU
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$OUT/jax_cache}  # bench reuses train's compile

SETS=(--set "train.steps=$STEPS" --set "train.batch_size=$BATCH" --set "model.remat=$REMAT"
      --set data.source=synthetic --set mesh.data=1 --set mesh.stage=1 --set mesh.fsdp=1
      --set mesh.tensor=1 --set optimizer.warmup_steps=10 "$@")

if [[ -n $AOT ]]; then
    start=$(date +%s)
    echo "gpu_check: --aot: $(date -u +%Y-%m-%dT%H:%MZ) compiling for 1 deviceless $KIND (no GPU needed)"
    jaxmp plan "$CONFIG" --devices 1 --device-kind "$KIND" --verify --aot \
        --dump-hlo "$OUT/aot" "${SETS[@]}"
    echo "gpu_check: --aot took $(( $(date +%s) - start )) s; the compiled HLO is in $OUT/aot"
    exit 0
fi

platform=$(python -c "import jax; d = jax.devices()[0]; print(d.platform, '|', d.device_kind, '|', jax.__version__)")
echo "gpu_check: $(date -u +%Y-%m-%dT%H:%MZ) device: $platform"
if [[ $platform != gpu* && -z ${GPU_CHECK_ALLOW_CPU:-} ]]; then
    echo "gpu_check: no GPU visible to jax (install jaxmp[cuda]); GPU_CHECK_ALLOW_CPU=1 for a dry run" >&2
    exit 1
fi

rm -rf "$OUT/train"
start=$(date +%s)
jaxmp train "$CONFIG" --run-dir "$OUT/train" "${SETS[@]}" --set logging.every=5 \
    --set checkpoint.enabled=false --set train.eval_every=0 --set logging.tensorboard=false

python - "$OUT/train/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steady = rows[1:] or rows  # the first interval holds the first steps' one-off costs
med = lambda k: statistics.median(r[k] for r in steady)
peak = max((r.get("peak_bytes") or 0) for r in rows)
peak = f"{peak / 2**30:.2f} GiB" if peak else "n/a (the backend does not report it)"
print(f"gpu_check: train: {med('tokens_per_s'):,.0f} tokens/s, MFU {med('mfu'):.1%}, "
      f"step {med('step_time_s') * 1e3:.0f} ms (median of {len(steady)} logged intervals), "
      f"peak memory {peak}, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
EOF
echo "gpu_check: train took $(( $(date +%s) - start )) s"

start=$(date +%s)
jaxmp bench "$CONFIG" --devices 1 --strategies dp --steps 10 --warmup 3 --out "$OUT/bench" "${SETS[@]}"
echo "gpu_check: bench took $(( $(date +%s) - start )) s; results in $OUT/bench/bench.md"
