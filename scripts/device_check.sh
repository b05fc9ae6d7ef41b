#!/usr/bin/env bash
# One command for a borrowed GPU machine (docs/gpu.md): installs the wheels carried in .whl/ (the machine has
# torch, transformers, peft and triton but no network), then runs the stages asked for and writes a log and
# every result JSON into one folder ($OUT when the device tool runs it, else ./device_check_out).
#
#   bash scripts/device_check.sh                 # env tests bench (about 6 minutes on an H100)
#   bash scripts/device_check.sh env tests       # only some stages; also: cpu (a CPU subset under that
#                                                # machine's torch/transformers), trl (tidal vs TRL on the GPU),
#                                                # smollm2 (the real model: its recipe and tidal vs TRL on it; its
#                                                # GGUF comes in two calls: scripts/device_model_parts.sh)
#
# Fill .whl/ first, on a machine with pip access: bash scripts/device_wheels.sh (reads scripts/device_wheels.txt).
# Each stage has its own time limit (TESTS_LIMIT, BENCH_LIMIT override two, in seconds), and one failing stage
# does not stop the next: the summary at the end
# says which passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-device_check_out}
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests bench)

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tidal-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/tidal-site" && echo "installed $(ls .whl/*.whl | wc -l) carried wheels"
fi

declare -A result
run_stage() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  local rc=$?
  result[$name]="rc=$rc $((SECONDS - start))s"
  echo "=== $name: ${result[$name]}"
}

for stage in "${stages[@]}"; do
  case $stage in
    env)
      run_stage env 60 "$PY" - <<'EOF'
import json, os, platform, subprocess, sys
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
json.dump(info, open(os.path.join(os.environ.get("OUT", "device_check_out"), "env.json"), "w"), indent=1)
subprocess.run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total,clocks.sm,driver_version",
                "--format=csv"], check=False)
EOF
      ;;
    tests)
      TIDAL_GPU_REPORT="$OUT_DIR/gpu_tests.jsonl" run_stage tests "${TESTS_LIMIT:-330}" \
        "$PY" -m pytest -q -m gpu tests/models tests/gpu -p no:cacheprovider -rfEs \
        --junitxml="$OUT_DIR/gpu_tests.xml" ;;
    cpu)  # the CPU logic under this machine's torch and transformers versions
      run_stage cpu 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/train/test_trainer.py \
        tests/train/test_precision.py tests/train/test_packing.py tests/train/test_prefix_tree.py \
        tests/rollout/test_local_engine.py tests/models ;;
    bench)
      run_stage bench "${BENCH_LIMIT:-240}" "$PY" -m tidal.cli bench gpu --out "$OUT_DIR" --set profile=true ;;
    trl)
      run_stage trl 240 "$PY" -m tidal.cli bench trl --out "$OUT_DIR" --set venv=current --set system.device=cuda \
        --set max_time_s=60 --set 'seeds=[0]' --set 'report_at=[30,60]' ;;
    smollm2)  # SmolLM2-135M-Instruct from the GGUF parts carried in two calls (docs/models.md), then its recipe
      bash scripts/device_model_parts.sh join && "$PY" -m tidal.cli model import smollm2-135m-instruct --no-download
      run_stage smollm2 240 "$PY" -m tidal.cli train smollm2_quickstart --out /tmp/smollm2 --overwrite \
        --set system.device=cuda --set max_time_s=120 --set log.report=false --set log.progress=false
      cp /tmp/smollm2/metrics.jsonl "$OUT_DIR/smollm2_metrics.jsonl" 2>/dev/null
      run_stage real 300 "$PY" -m tidal.cli bench real --out "$OUT_DIR" --set venv=current --set system.device=cuda \
        --set max_time_s=90 --set snapshot_every_s=30 --set 'lora_ranks=[]' --set 'report_at=[30,60,90]' ;;
    *) echo "unknown stage $stage (env tests cpu bench trl smollm2)"; result[$stage]="unknown" ;;
  esac
done

echo "=== summary"
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
