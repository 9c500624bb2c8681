#!/usr/bin/env bash
# GPU check of the validator, for a machine with one NVIDIA GPU; about 4 minutes, under 8.
#
#   validate/gpu_check.sh [OUT_DIR]          # on the GPU: NCCL + CUDA allocator statistics
#   validate/gpu_check.sh --cpu [OUT_DIR]    # the same steps on CPU (gloo, MemTracker), small, as a dry run
#
# Every step is `zeroplan validate` (prediction vs measurement, row by row); on CUDA the measurement is the
# caching allocator's memory_allocated / max_memory_allocated per phase, not MemTracker.
# 1. reference runtime, real run at world size 1 (NCCL on the GPU): stages 0-3 on gpt-tiny and mlp-tiny;
#    no collectives are predicted or allowed at N_d = 1; model states within 1% (mlp-tiny: 2%, below).
# 2. reference runtime, simulated: rank 0 of N_d = 8 and 64 on a fake process group with real CUDA
#    tensors (a ~300M-parameter GPT), memory per phase from the allocator.
# 3. FSDP2 (real fully_shard), simulated with real CUDA tensors: rank 0 of N_d = 8 and 64 (the same GPT,
#    bf16 MixedPrecisionPolicy), reshard off, checkpointing full, fp32, meta-device init, and
#    Llama-2-7B's config at 64 (meta and materialized init).
#    One GPU cannot hold two NCCL ranks, so FSDP2's collectives are checked on the fake group (elements
#    per call, as on gloo); its world-size-1 shortcut (no collectives) is not a case zeroplan models.
# 4. Opt-in, ONLY=snapshot: the FSDP2 bf16 run at N_d = 8 again, with the CUDA allocator's snapshot at each
#    reading of its last step and the live bytes by allocation site (the residual of docs/validate.md).
# Writes OUT_DIR/<step>.{json,txt} and OUT_DIR/summary.txt; exits non-zero when any row is out of
# tolerance or a step fails.
set -uo pipefail

device=cuda
if [[ "${1:-}" == "--cpu" ]]; then device=cpu; shift; fi
out=${1:-gpu_check_out}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
configs=$here/tests/data/hf_configs
params=3e8; seq=128; llama=$configs/llama-2-7b.json
if [[ $device == cpu ]]; then params=2e6; seq=16; llama=$configs/tiny-llama.json; fi

python - "$device" > "$out/env.txt" <<'PY'
import sys, torch
device = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU visible; run with --cpu for the CPU path")
    print("gpu", torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
PY
cat "$out/env.txt"

status=0
if [[ $device == cuda && cuda_extras =~ ${ONLY:-.} ]]; then  # library workspaces, op by op (validate/cuda_extras.py)
  timeout 60 python -m validate.cuda_extras > "$out/cuda_extras.json" || status=1
  cat "$out/cuda_extras.json"
fi
only=${ONLY:-.}  # ONLY=REGEX runs the steps whose name matches (e.g. ONLY=fsdp2 for a rerun)
step() {  # step NAME SECONDS ARGS...: one `zeroplan validate`, its table in NAME.txt, its rows in NAME.json
  local name=$1 limit=$2; shift 2
  [[ $name =~ $only ]] || return 0
  local t0=$SECONDS
  if timeout "$limit" python -c 'from zeroplan.cli import main; main()' validate --device "$device" "$@" \
      --json "$out/$name.json" > "$out/$name.txt" 2>&1; then
    echo "ok    $name ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
  else
    echo "FAIL  $name ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"; status=1
  fi
  grep -v '^states:\|^gloo runs' "$out/$name.txt"
}

# The caching allocator rounds every block up to 512 bytes: 5 model-state tensors on gpt-tiny's 568 KiB
# add under 0.1 %, on mlp-tiny's 125 KiB up to 1.4 %, hence its 2 % tolerance.
step ref_ws1_gpt 90 --world-size 1 --model gpt-tiny --tolerance 0.01
step ref_ws1_mlp 60 --world-size 1 --model mlp-tiny --tolerance 0.02
step ref_sim 120 --simulated --world-size 8 --world-size 64 --params "$params" --steps 2 --batch-per-rank 1 \
  --seq-len "$seq"
sim=(--engine fsdp2 --simulated --real-tensors --steps 2 --batch-per-rank 1)
step fsdp2_sim_bf16 90 "${sim[@]}" --world-size 8 --world-size 64 --params "$params" --seq-len "$seq"
step fsdp2_sim_noreshard_ckpt 60 "${sim[@]}" --world-size 8 --params "$params" --seq-len "$seq" \
  --reshard-after-forward false --checkpointing full
step fsdp2_sim_fp32 60 "${sim[@]}" --world-size 8 --params "$params" --seq-len "$seq" --param-dtype fp32
step fsdp2_sim_meta 60 "${sim[@]}" --world-size 8 --params "$params" --seq-len "$seq" --init meta
step fsdp2_sim_llama_meta 90 "${sim[@]}" --world-size 64 --model "$llama" --seq-len "$seq" --reduce-dtype fp32 \
  --init meta
step fsdp2_sim_llama 120 "${sim[@]}" --world-size 64 --model "$llama" --seq-len "$seq" --reduce-dtype fp32
# Opt-in (ONLY=snapshot): the 305M GPT's FSDP2 residual at N_d = 8, with the allocator's record of what is
# live at each reading of the last step, by allocation site (validate/cuda_snapshot.py; pickles for memory_viz).
if [[ ${ONLY:-} =~ snapshot ]]; then
  only=snapshot
  ZEROPLAN_CUDA_SNAPSHOT="$out/snapshots" step fsdp2_snapshot 120 "${sim[@]}" --world-size 8 --params "$params" \
    --seq-len "$seq"
  if [[ $device == cuda ]]; then  # on CPU (--cpu) nothing is recorded
    python -m validate.cuda_snapshot "$out/snapshots" > "$out/fsdp2_snapshot_sites.txt" || status=1
    cat "$out/fsdp2_snapshot_sites.txt"
  fi
fi
exit $status
