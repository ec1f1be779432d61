#!/usr/bin/env bash
# The prepared GPU check: everything we want measured on an accelerator, in one run of about 8 minutes.
#
#   bash benchmarks/gpu_check.sh OUT_DIR            on a GPU machine (installs '.[cuda]' first: into $PYTHON, an
#                                                   activated environment, or the repository's .venv)
#   bash benchmarks/gpu_check.sh OUT_DIR --toy      on CPU at toy sizes (the test suite runs this)
#
# Steps, each bounded by `timeout` and recorded even when it fails (the others still run):
#   1. ResNet-50 training throughput (benchmarks/throughput.py): bfloat16 and float16, 128 and 224 px, the
#      largest per-device batch of 256, 192, 128, 64 that fits;
#   2. the gradient collectives on the device (benchmarks/collectives.py): per strategy, exact against
#      MSTopK top-k selection;
#   3. the input pipeline (benchmarks/input_pipeline.py), images/s per host core;
#   3b. the optimizer update of ResNet-50 with LARS, norms per tensor against fused, and sharded against
#       replicated across the GPUs when there are several (benchmarks/update_step.py);
#   3c. the device's top-k selection rate, and the link between its GPUs when there are several
#       (benchmarks/calibrate_links.py): the rate comm.strategy=auto and the simulator otherwise assume;
#   4. a short training run (train.py on generated JPEGs, ResNet-50 at 128 px) with a profile of 5 steps.
# Writes OUT_DIR/gpu_check.json (every step's JSON line, its exit code and seconds) and OUT_DIR/report.txt
# (the tables), plus each step's log and the profile under OUT_DIR/train/profile.
set -u
USAGE="usage: bash benchmarks/gpu_check.sh OUT_DIR [--toy]"
case "${1:-}" in
  -h|--help) echo "$USAGE"; exit 0 ;;
  "") echo "$USAGE" >&2; exit 2 ;;
  -*) echo "error: the first argument is the output folder, not $1; $USAGE" >&2; exit 2 ;;
esac
OUT=$1
TOY=${2:-}
if [ -n "$TOY" ] && [ "$TOY" != "--toy" ] || [ $# -gt 2 ]; then
  echo "error: unexpected arguments after OUT_DIR: ${*:2}; $USAGE" >&2
  exit 2
fi
# Before anything is written: a run refused here leaves an earlier run's results in OUT_DIR as they were.
if [ "$TOY" != "--toy" ] && ! command -v nvidia-smi > /dev/null; then
  echo "error: nvidia-smi not found: this is not a GPU machine. On CPU run: bash $0 $OUT --toy" >&2
  exit 2
fi
mkdir -p -- "$OUT" 2> /dev/null || { echo "error: cannot create the output folder $OUT" >&2; exit 2; }
OUT=$(cd -- "$OUT" && pwd) || { echo "error: cannot enter the output folder $1" >&2; exit 2; }
PROBE=$(mktemp "$OUT/.writable.XXXXXX" 2> /dev/null) \
  || { echo "error: cannot write in the output folder $OUT (permissions, or a read-only file system)" >&2; exit 2; }
rm -f -- "$PROBE"
cd "$(dirname "$0")/.."
# The Python to install into and run: $PYTHON; else an activated venv or conda environment's; else the repository's
# .venv (made here on a GPU machine without one: a system Python may refuse pip installs, PEP 668).
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] || [ "$TOY" = "--toy" ]; then PY=python3
else
  # A half-made one (python3-venv missing when it was made) has no pip: made again.
  .venv/bin/python -m pip --version > /dev/null 2>&1 || { rm -rf .venv && python3 -m venv .venv; } \
    || { echo "error: cannot create .venv (Debian/Ubuntu: sudo apt-get install -y python3-venv); or set PYTHON=" >&2; exit 2; }
  PY=$PWD/.venv/bin/python
fi
: > "$OUT/steps.jsonl"

# A Ctrl-C or SIGTERM stops the check: `timeout` runs each step in a process group of its own, which a terminal's
# Ctrl-C does not reach, so the step is stopped here (timeout passes the SIGTERM on to it), then the check.
STEP_NAME=
stop() {
  local step; step=$(jobs -p)  # the step's timeout, if it has started
  if [ -n "$step" ]; then kill -TERM $step 2> /dev/null; wait $step 2> /dev/null; fi
  echo "stopped by SIG$1${STEP_NAME:+ during the step $STEP_NAME}; the steps before it are in $OUT/steps.jsonl" >&2
  exit "$2"
}
trap 'stop INT 130' INT
trap 'stop TERM 143' TERM

run() {  # run NAME SECONDS COMMAND...: its output to OUT/NAME.log, a record to OUT/steps.jsonl
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  STEP_NAME=$name
  echo "== $name: $*" | tee -a "$OUT/report.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 &  # waited for here, where a trapped signal ends the wait
  wait $!
  local code=$?
  STEP_NAME=
  grep -v '^{' "$OUT/$name.log" | tail -n 12 >> "$OUT/report.txt"
  "$PY" - "$name" "$code" "$((SECONDS - start))" "$OUT/$name.log" >> "$OUT/steps.jsonl" <<'EOF'
import json, sys
name, code, seconds, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lines = [l for l in open(log, errors="replace").read().splitlines() if l.startswith("{")]
try:
  result = json.loads(lines[-1]) if lines else None
except json.JSONDecodeError:
  result = None
print(json.dumps({"step": name, "exit_code": code, "seconds": seconds, "result": result}))
EOF
  return $code
}

: > "$OUT/report.txt"
echo "light_jax GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  | tee -a "$OUT/report.txt"
if [ "$TOY" = "--toy" ]; then
  MODEL=(--model resnet8_small --num_classes 10 --config.model.width=8 --steps 2 --warmup 1 --cpu_devices 2)
  SIZES=(32); BATCHES=(8 4); DTYPES=(float32)
  COLLECTIVES=(--nodes 1 --local 2 --repeats 1 --only hitopk@0.01/mstopk --model resnet8_small)
  INPUT=(--images 20 --rounds 1 --seconds 0.2)
  UPDATE=(--model resnet18 --image 32 --batch_per_device 2 --rounds 1)
  LINKS=(--nodes 1 --local 2 --repeats 1 --max_mib 4)
  TRAIN=(--config.model.name=resnet8_small --config.model.width=8 --config.data.image_size=32
         --config.data.resolution_schedule= --config.mesh.cpu_devices=2 --config.num_epochs=3 --config.global_batch_size=16
         --config.max_steps=12 --config.data.eval_batch_size=20 --config.train.profile_steps=6:9)
  IMAGES=8
else
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  if ! "$PY" -m pip install --quiet -e '.[cuda]' > "$OUT/pip.log" 2>&1; then
    echo "error: pip install -e '.[cuda]' failed; see $OUT/pip.log" >&2
    exit 2
  fi
  MODEL=(--model resnet50 --steps 20 --warmup 3)
  SIZES=(128 224); BATCHES=(256 192 128 64); DTYPES=(bfloat16 float16)
  COLLECTIVES=(--nodes 1 --local -1 --repeats 5
               --only hierarchical,hitopk@0.01,hitopk@0.01/mstopk,hitopk@0.001,hitopk@0.001/mstopk,gtopk@0.01,topk@0.001,powersgd@4)
  INPUT=(--images 200 --rounds 2 --seconds 2)
  UPDATE=(--model resnet50 --batch_per_device 128 --rounds 10 --local "$(nvidia-smi -L | wc -l)")  # sharded: >= 2 GPUs
  LINKS=(--nodes 1 --local "$(nvidia-smi -L | wc -l)" --repeats 5 --max_mib 64)
  # ResNet-50 itself (tiny's width 16 off), in bfloat16, its decoded cache at the training size.
  TRAIN=(--config.model.name=resnet50 --config.model.width=0 --config.model.dtype=bfloat16
         --config.data.image_size=128 --config.data.cache_size=128 --config.data.resolution_schedule=
         --config.global_batch_size=256 --config.num_epochs=20 --config.max_steps=150
         --config.train.profile_steps=100:105)
  IMAGES=300
fi

for dtype in "${DTYPES[@]}"; do
  for size in "${SIZES[@]}"; do
    for batch in "${BATCHES[@]}"; do  # the largest batch that fits: a failure (out of memory) tries the next
      run "throughput_${dtype}_${size}_b${batch}" 150 "$PY" benchmarks/throughput.py "${MODEL[@]}" \
        --image_size "$size" --batch_per_device "$batch" --dtype "$dtype" && break
    done
  done
done
run collectives 120 "$PY" benchmarks/collectives.py "${COLLECTIVES[@]}"
run input_pipeline 90 "$PY" benchmarks/input_pipeline.py "${INPUT[@]}"
run update_step 400 "$PY" benchmarks/update_step.py "${UPDATE[@]}"  # compiles ~10 programs (2 on a mesh)
run calibrate_links 120 "$PY" benchmarks/calibrate_links.py "${LINKS[@]}" --out "$OUT/links.json"

# Training data: a small folder of generated JPEGs (10 classes), prepared as the README says.
DATA="$OUT/data"
"$PY" - "$DATA/folder" "$IMAGES" <<'EOF'
import os, sys
import numpy as np
sys.path.insert(0, os.getcwd())
from tests.image_folder_fixture import class_image
root, per_class = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
for split, count in (("train", per_class), ("val", max(per_class // 10, 2))):
  for label in range(10):
    os.makedirs(f"{root}/{split}/class{label}", exist_ok=True)
    for i in range(count):
      class_image(label, rng, 160, 120).save(f"{root}/{split}/class{label}/{i}.jpg", quality=90)
EOF
run prepare_data 120 "$PY" scripts/prepare_image_folder.py --folder "$DATA/folder" --out "$DATA/prepared"
run train 240 "$PY" train.py --config configs/imagenet_resnet50.py:tiny --workdir "$OUT/train" \
  --config.data.dataset=image_folder --config.data.data_dir="$DATA/prepared" --config.data.cache_dir="$DATA/cache" \
  --config.mesh.nodes=1 \
  --config.mesh.local=-1 --config.checkpoint.every_steps=0 "${TRAIN[@]}"
if [ -f "$OUT/train/summary.json" ]; then
  "$PY" -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$OUT/train/summary.json" \
    > "$OUT/train_summary.json"
fi

"$PY" - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
best = {}
for s in steps:
  r = s["result"]
  if s["step"].startswith("throughput_") and s["exit_code"] == 0 and r:
    key = f"{r['dtype']}@{r['image_size']}"
    if key not in best or r["batch_per_device"] > best[key]["batch_per_device"]:
      best[key] = r
profile = sorted(glob.glob(os.path.join(out, "train", "profile", "**", "*.xplane.pb"), recursive=True))
# A throughput attempt that ran out of memory is expected (a smaller batch follows); a size that never ran is not.
tried = {s["step"].rsplit("_b", 1)[0] for s in steps if s["step"].startswith("throughput_")}
failed = [t for t in sorted(tried) if not any(f"throughput_{k.replace('@', '_')}" == t for k in best)]
failed += [s["step"] for s in steps if not s["step"].startswith("throughput_") and s["exit_code"] != 0]
links = next((s["result"] for s in steps if s["step"] == "calibrate_links" and s["exit_code"] == 0), None)
topk_rate = links["topk_elements_per_sec"] if links else None  # elements/s: auto and the simulator assume one
summary = {"steps": steps, "throughput": best, "topk_elements_per_sec": topk_rate,
           "profile": profile[0] if profile else None, "failed": failed}
json.dump(summary, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
with open(os.path.join(out, "report.txt"), "a") as f:
  f.write("\nthroughput (largest batch that fit): " + ", ".join(
    f"{k}: {v['images_per_sec']:.0f} images/s per device at batch {v['batch_per_device']}" for k, v in best.items()) + "\n")
  f.write(f"top-k selection: {topk_rate and f'{topk_rate:.3g}'} elements/s\n")
  f.write(f"profile: {summary['profile']}\nfailed steps: {summary['failed'] or 'none'}\n")
print(json.dumps({"throughput": {k: v["images_per_sec"] for k, v in best.items()}, "topk_elements_per_sec": topk_rate,
                  "failed": summary["failed"], "profile": summary["profile"]}))
EOF
