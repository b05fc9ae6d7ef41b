#!/usr/bin/env bash
# One command for a borrowed GPU machine (docs/gpu.md): installs the wheels carried in .whl/ (the machine has
# torch, transformers, peft and triton but no network), then runs the stages asked for and writes a log and
# every result JSON into one folder ($OUT when the device tool runs it, else ./device_check_out).
#
#   bash scripts/device_check.sh                 # env tests bench: at most 30 + 170 + 270 s = 7.8 minutes (the
#                                                # issue-51 budget: 8 minutes, leaving a rerun in 15), whatever
#                                                # the machine; the bench stops its own parts in time (budget_s)
#   bash scripts/device_check.sh --dry-run       # on a CPU, no GPU: every stage with tiny shapes (env tests cpu
#                                                # bench trl smollm2), what CI runs (tests/test_device_check.py)
#   bash scripts/device_check.sh env tests       # only some stages; also: cpu (a CPU subset under that
#                                                # machine's torch/transformers), trl (tidal vs TRL on the GPU),
#                                                # smollm2 (the real model: its recipe and tidal vs TRL on it; its
#                                                # GGUF comes in two calls: scripts/device_model_parts.sh),
#                                                # moe (tidal bench moe: a CUDA bf16 engine, its CUDA graphs
#                                                # recording routes, against an fp32 trainer; off vs r3),
#                                                # arms (rollout.decode_attention repeat/gqa/fold,
#                                                # trainer.weights fp32/bf16_master, rollout.host_reads
#                                                # sync/late, trainer.head_kernel chunked/fused/compiled and
#                                                # rollout.graph_widths full/buckets, side by side)
#
# Fill .whl/ first, on a machine with pip access: bash scripts/device_wheels.sh (reads scripts/device_wheels.txt).
# Each stage has its own time limit (<STAGE>_LIMIT overrides it, in seconds: ENV_LIMIT, TESTS_LIMIT, CPU_LIMIT,
# BENCH_LIMIT, ARMS_LIMIT, TRL_LIMIT, SMOLLM2_LIMIT, REAL_LIMIT, MOE_LIMIT; DRY_LIMIT every stage's in a dry run, default 120), one
# failing stage does not stop the next, and each stage writes stage_<name>.json (rc, seconds, limit, timed_out)
# and rewrites device_check.json (every stage so far) before the next starts: a time-out loses only its own
# stage. The summary at the end says which passed.
# The dry run hides any GPU (CUDA_VISIBLE_DEVICES=), installs no wheels, runs the GPU tests (they skip without
# CUDA), only collects the cpu stage's tests, runs tidal bench gpu with --set tiny=true, and for trl and smollm2
# (which need TRL's wheels and the model's parts) resolves their commands' settings.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-device_check_out}
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
stages=("$@")
if [ ${#stages[@]} -eq 0 ]; then
  if ((DRY)); then stages=(env tests cpu bench arms trl smollm2 moe); else stages=(env tests bench); fi
fi
dry_json=false
if ((DRY)); then
  dry_json=true
  export CUDA_VISIBLE_DEVICES=""
  echo "DRY RUN on the CPU (no GPU used, tiny shapes): stages ${stages[*]}"
fi

if ((!DRY)) && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tidal-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/tidal-site" && echo "installed $(ls .whl/*.whl | wc -l) carried wheels"
fi

declare -A result
stage_json=()
limit() {  # stage name, default (s): <NAME>_LIMIT if set, else DRY_LIMIT (default 120) in a dry run, else the default
  local var="${1^^}_LIMIT"
  if [ -n "${!var:-}" ]; then echo "${!var}"; elif ((DRY)); then echo "${DRY_LIMIT:-120}"; else echo "$2"; fi
}
run_stage() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  local rc=$?
  local timed_out=false
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then timed_out=true; fi
  result[$name]="rc=$rc $((SECONDS - start))s"
  [ $timed_out = true ] && result[$name]+=" (timed out)"
  echo "=== $name: ${result[$name]}"
  # written before the next stage starts: a later time-out or kill cannot lose this stage's record
  local json
  json=$(printf '{"stage": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "timed_out": %s, "dry_run": %s, "finished_utc": "%s"}' \
    "$name" "$rc" "$((SECONDS - start))" "$limit" "$timed_out" "$dry_json" "$(date -u +%Y-%m-%dT%H:%M:%SZ)")
  echo "$json" > "$OUT_DIR/stage_$name.json"
  stage_json+=("$json")
  local IFS=,
  printf '{"dry_run": %s, "stages": [%s]}\n' "$dry_json" "${stage_json[*]}" > "$OUT_DIR/device_check.json"
}

for stage in "${stages[@]}"; do
  case $stage in
    env)
      run_stage env "$(limit env 30)" "$PY" - "$OUT_DIR/env.json" <<'EOF'
import json, platform, shutil, subprocess, sys
import torch, transformers
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "platform": platform.platform(),
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                bf16=torch.cuda.is_bf16_supported())
for name in ("peft", "trl", "datasets", "triton", "accelerate"):
    try:
        info[name] = __import__(name).__version__
    except Exception as e:  # noqa: BLE001 (a report, not a check)
        info[name] = f"missing ({type(e).__name__})"
print(json.dumps(info, indent=1))
json.dump(info, open(sys.argv[1], "w"), indent=1)
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,clocks.sm,driver_version",
                    "--format=csv"], check=False)
EOF
      ;;
    tests)  # without CUDA (a dry run) every test here skips: the run proves they collect
      TIDAL_GPU_REPORT="$OUT_DIR/gpu_tests.jsonl" run_stage tests "$(limit tests 170)" \
        "$PY" -m pytest -q -m gpu tests/models tests/gpu tests/rollout/test_late_reads.py tests/rollout/test_graph_widths.py \
        -p no:cacheprovider -rfEs \
        --junitxml="$OUT_DIR/gpu_tests.xml" ;;
    cpu)  # the CPU logic under this machine's torch and transformers versions (a dry run only collects it)
      collect=()
      ((DRY)) && collect=(--collect-only)
      run_stage cpu "$(limit cpu 240)" "$PY" -m pytest -q -x -p no:cacheprovider "${collect[@]}" \
        tests/train/test_trainer.py tests/train/test_precision.py tests/train/test_packing.py \
        tests/train/test_prefix_tree.py tests/rollout/test_local_engine.py tests/models ;;
    bench)
      tiny=()
      ((DRY)) && tiny=(--set device=cpu --set tiny=true)
      bench_limit=$(limit bench 270)  # the bench stops itself 30 s early (budget_s), so gpu.json is always written
      run_stage bench "$bench_limit" "$PY" -m tidal.cli bench gpu --out "$OUT_DIR" --set profile=true \
        --set "budget_s=$((bench_limit > 60 ? bench_limit - 30 : bench_limit * 3 / 4))" "${tiny[@]}" ;;
    arms)  # issue 51's keys, each against today's path on the same model and rows (docs/gpu.md)
      tiny=()
      ((DRY)) && tiny=(--set device=cpu --set tiny=true)
      # head_kernel (trainer.head_kernel chunked/fused/compiled, fp32 and tf32; its torch.compile ~30 s), then
      # graph_widths (rollout.graph_widths full/buckets at a 4,096-token budget, est. ~30 s: its 30 s more limit):
      # each part's JSON is written when it ends (gpu_partial.json), so a time-out there loses only that part
      run_stage arms "$(limit arms 270)" "$PY" -m tidal.cli bench gpu --out "$OUT_DIR/arms" \
        --set 'parts=[decode_attention,train,train_bf16_master,host_reads,head_kernel,graph_widths]' "${tiny[@]}" ;;
    trl|smollm2)
      if ((DRY)); then  # no TRL wheels, no model parts on a CPU runner: the stage's commands' settings resolve
        run_stage "$stage" "$(limit "$stage" 60)" "$PY" - "$stage" <<'EOF'
import sys
from tidal import bench
from tidal.config import apply_overrides
from tidal.recipes import RECIPES
if sys.argv[1] == "trl":
    bench.load("trl").resolve(["venv=current", "system.device=cuda", "max_time_s=60", "seeds=[0]", "report_at=[30,60]"])
    try:
        import trl  # noqa: F401
        print("trl importable")
    except ImportError:
        print("trl not importable here (the device machine gets it from .whl/)")
else:
    apply_overrides(RECIPES.get("smollm2_quickstart")(), ["system.device=cuda", "max_time_s=120", "log.report=false",
                                                          "log.progress=false"])
    bench.load("real").resolve(["venv=current", "system.device=cuda", "max_time_s=90", "snapshot_every_s=30",
                                "lora_ranks=[]", "report_at=[30,60,90]"])
print(f"dry run: the {sys.argv[1]} stage's settings resolve")
EOF
      elif [ "$stage" = trl ]; then
        run_stage trl "$(limit trl 240)" "$PY" -m tidal.cli bench trl --out "$OUT_DIR" --set venv=current \
          --set system.device=cuda --set max_time_s=60 --set 'seeds=[0]' --set 'report_at=[30,60]'
      else  # SmolLM2-135M-Instruct from the GGUF parts carried in two calls (docs/models.md), then its recipe
        bash scripts/device_model_parts.sh join && "$PY" -m tidal.cli model import smollm2-135m-instruct --no-download
        run_stage smollm2 "$(limit smollm2 240)" "$PY" -m tidal.cli train smollm2_quickstart --out /tmp/smollm2 \
          --overwrite --set system.device=cuda --set max_time_s=120 --set log.report=false --set log.progress=false
        cp /tmp/smollm2/metrics.jsonl "$OUT_DIR/smollm2_metrics.jsonl" 2>/dev/null
        run_stage real "$(limit real 300)" "$PY" -m tidal.cli bench real --out "$OUT_DIR" --set venv=current \
          --set system.device=cuda --set max_time_s=90 --set snapshot_every_s=30 --set 'lora_ranks=[]' \
          --set 'report_at=[30,60,90]'
      fi ;;
    moe)  # issue 52 on the device: a CUDA bf16 engine (CUDA graphs record the routes), an fp32 trainer, off vs r3
      extra=(--set system.device=cuda --set trainer.precision=fp32)
      ((DRY)) && extra=(--set model.hidden_size=32 --set model.num_layers=1 --set model.num_heads=2
        --set model.num_kv_heads=2 --set model.expert_intermediate_size=16 --set sft.steps=2
        --set sft.accuracy_band=null --set rollout.prompts_per_step=4 --set num_eval=8 --set steps=2)
      run_stage moe "$(limit moe 240)" "$PY" -m tidal.cli bench moe --out "$OUT_DIR" --set 'seeds=[0]' --set steps=20 \
        --set 'arms=[off,r3]' --set reuse=false "${extra[@]}" ;;
    *) echo "unknown stage $stage (env tests cpu bench trl smollm2 moe)"; result[$stage]="unknown" ;;
  esac
done

echo "=== summary$( ((DRY)) && echo ' (DRY RUN on the CPU: no GPU figures)')"
for stage in "${stages[@]}"; do echo "$stage: ${result[$stage]:-not run}"; done
for f in "$OUT_DIR"/gpu.json "$OUT_DIR"/trl.json "$OUT_DIR"/real.json; do
  [ -f "$f" ] && "$PY" - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[1], json.dumps({k: v for k, v in r.items() if k != "table"}))
EOF
done
[ -f "$OUT_DIR/gpu_tests.jsonl" ] && cat "$OUT_DIR/gpu_tests.jsonl"
exit 0
