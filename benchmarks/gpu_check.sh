#!/usr/bin/env bash
# The prepared GPU check: everything we want measured on an accelerator, in one run of at most --budget seconds.
#
#   bash benchmarks/gpu_check.sh OUT_DIR            on a GPU machine (installs '.[cuda]' first: into $PYTHON, an
#                                                   activated environment, or the repository's .venv)
#   bash benchmarks/gpu_check.sh OUT_DIR --wheels .whl
#                                                   on a GPU machine that has JAX with CUDA but no network (this
#                                                   workplace's device machines): $PYTHON or python3 as it is, the
#                                                   packages it lacks from the wheels `make gpu-wheels` downloads,
#                                                   light_jax from this checkout (PYTHONPATH), nothing installed
#   bash benchmarks/gpu_check.sh OUT_DIR --toy      on CPU at toy sizes (the test suite runs this)
#
# Steps, in the order of what they are worth (the budget may not reach the last), each bounded by `timeout` and by
# the time left, and recorded even when it fails or is skipped (the others still run):
#   0. preflight: the versions, the devices, one program on them (with XLA's flags left to JAX's defaults if this
#      JAX's XLA refuses ours; the check stops here if the program cannot run), and which light_jax modules import;
#   1. ResNet-50 training throughput (benchmarks/throughput.py) in bfloat16 at 224 px, the largest per-device batch
#      of 256, 192, 128, 64 that fits (a smaller one is tried only after an out-of-memory error);
#   2. the device's top-k selection rate, and the link between its GPUs when there are several
#      (benchmarks/calibrate_links.py): the rate comm.strategy=auto and the simulator otherwise assume;
#   3. the gradient collectives on the device (benchmarks/collectives.py): per strategy, exact against MSTopK
#      top-k selection (on one GPU no communication: the selections and the packing alone);
#   4. a short training run (train.py on generated JPEGs, ResNet-50 at 128 px) with a profile of 5 steps;
#   5. throughput in bfloat16 at 128 px and float16 at 224 px;
#   6. the optimizer update of ResNet-50 with LARS, norms per tensor against fused, and sharded against
#      replicated across the GPUs when there are several (benchmarks/update_step.py);
#   7. the input pipeline (benchmarks/input_pipeline.py), images/s per host core.
# After every step it writes OUT_DIR/gpu_check.json (every step's JSON line, exit code and seconds, the training run's
# summary, and the figures drawn from them), OUT_DIR/report.txt (the tables), OUT_DIR/logs.tar.gz (each step's log)
# and OUT_DIR/profile.tar.gz; a run cut short still leaves them. --budget: 540 s by default on a GPU (a device
# machine's command runs at most 600 s; 25 s of it kept for the summary), none at toy size.
set -u
USAGE="usage: bash benchmarks/gpu_check.sh OUT_DIR [--toy] [--wheels DIR] [--budget SECONDS]"
case "${1:-}" in
  -h|--help) echo "$USAGE"; exit 0 ;;
  "") echo "$USAGE" >&2; exit 2 ;;
  -*) echo "error: the first argument is the output folder, not $1; $USAGE" >&2; exit 2 ;;
esac
OUT=$1; shift
TOY= WHEELS= BUDGET= BUDGET_GIVEN=
while [ $# -gt 0 ]; do
  case "$1" in
    --toy) TOY=--toy; shift ;;
    --wheels) [ $# -ge 2 ] || { echo "error: --wheels needs a folder of wheels; $USAGE" >&2; exit 2; }
              WHEELS=$2; shift 2 ;;
    --budget) [ $# -ge 2 ] || { echo "error: --budget needs seconds; $USAGE" >&2; exit 2; }
              BUDGET=$2; BUDGET_GIVEN=1; shift 2 ;;
    *) echo "error: unexpected arguments after OUT_DIR: $*; $USAGE" >&2; exit 2 ;;
  esac
done
if [ -n "$BUDGET_GIVEN" ] && { ! [[ "$BUDGET" =~ ^[1-9][0-9]{1,5}$ ]] || [ "$BUDGET" -lt 55 ]; }; then
  echo "error: --budget '$BUDGET': give whole seconds, at least 55 (25 for the summary, 30 for the preflight)" >&2
  exit 2
fi
if [ -n "$WHEELS" ] && ! compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "error: --wheels $WHEELS holds no .whl file; download them on a machine with pip's network: make gpu-wheels" >&2
  exit 2
fi
# Before anything is written: a run refused here leaves an earlier run's results in OUT_DIR as they were.
if [ "$TOY" != "--toy" ] && ! command -v nvidia-smi > /dev/null; then
  echo "error: nvidia-smi not found: this is not a GPU machine. On CPU run: bash $0 $OUT --toy" >&2
  exit 2
fi
mkdir -p -- "$OUT" 2> /dev/null || { echo "error: cannot create the output folder $OUT" >&2; exit 2; }
OUT=$(cd -- "$OUT" && pwd) || { echo "error: cannot enter the output folder $OUT" >&2; exit 2; }
PROBE=$(mktemp "$OUT/.writable.XXXXXX" 2> /dev/null) \
  || { echo "error: cannot write in the output folder $OUT (permissions, or a read-only file system)" >&2; exit 2; }
rm -f -- "$PROBE"
if [ -n "$WHEELS" ]; then WHEELS=$(cd -- "$WHEELS" && pwd); fi
cd "$(dirname "$0")/.."
REPO=$PWD
# Scratch (the generated images, their records and cache, the installed wheels): not in OUT_DIR, which comes back.
SCRATCH=$(mktemp -d) || { echo "error: cannot make a temporary folder" >&2; exit 2; }
trap 'rm -rf -- "$SCRATCH"' EXIT
# The Python to run: with --wheels or --toy, $PYTHON or python3 as it is; else the one to install into: $PYTHON; else
# an activated venv or conda environment's; else the repository's .venv (made here on a GPU machine without one: a
# system Python may refuse pip installs, PEP 668).
if [ -n "$WHEELS" ] || [ "$TOY" = "--toy" ]; then PY=${PYTHON:-python3}
elif [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then PY=python3
else
  # A half-made one (python3-venv missing when it was made) has no pip: made again.
  .venv/bin/python -m pip --version > /dev/null 2>&1 || { rm -rf .venv && python3 -m venv .venv; } \
    || { echo "error: cannot create .venv (Debian/Ubuntu: sudo apt-get install -y python3-venv); or set PYTHON=" >&2; exit 2; }
  PY=$PWD/.venv/bin/python
fi
if [ -z "$BUDGET" ] && [ "$TOY" != "--toy" ]; then BUDGET=540; fi
DEADLINE=$((SECONDS + ${BUDGET:-0}))
export PYTHONUNBUFFERED=1  # a step killed at its limit keeps the lines it printed
rm -rf -- "$OUT"/{gpu_check.json,logs.tar.gz,profile.tar.gz,links.json,train_summary.json,logs,train}  # an earlier run's
mkdir -p "$OUT/logs"
: > "$OUT/steps.jsonl"
: > "$OUT/report.txt"

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

# OUT/gpu_check.json and OUT/logs.tar.gz from the steps so far, run after each step (a run cut short by a machine's
# limit still leaves them); prints report.txt's closing lines, the last one JSON.
summarize() {
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
skipped = [s["step"] for s in steps if s.get("skipped")]
# A throughput attempt that ran out of memory is expected (a smaller batch follows); a size that never ran is not.
tried = {s["step"].rsplit("_b", 1)[0] for s in steps if s["step"].startswith("throughput_") and not s.get("skipped")}
failed = [t for t in sorted(tried) if not any(f"throughput_{k.replace('@', '_')}" == t for k in best)]
# preflight_with_flags: the preflight that XLA's refusal of light_jax's flags stopped; run again without them.
failed += [s["step"] for s in steps if not s["step"].startswith("throughput_") and s["exit_code"] and not s.get("skipped")
           and s["step"] != "preflight_with_flags"]
links = next((s["result"] for s in steps if s["step"] == "calibrate_links" and s["exit_code"] == 0), None)
topk_rate = links["topk_elements_per_sec"] if links else None  # elements/s: auto and the simulator assume one
preflight = next((s["result"] for s in steps if s["step"] == "preflight" and s["result"]), None)
try:  # the training run's summary.json (train.py prints no JSON line)
  train = json.load(open(os.path.join(out, "train", "summary.json")))
except (OSError, ValueError):
  train = None
summary = {"preflight": preflight, "steps": steps, "throughput": best, "topk_elements_per_sec": topk_rate,
           "train": train, "profile": profile[0] if profile else None, "failed": failed, "skipped": skipped}
with open(os.path.join(out, "gpu_check.json.tmp"), "w") as f:
  json.dump(summary, f, indent=1)
os.replace(os.path.join(out, "gpu_check.json.tmp"), os.path.join(out, "gpu_check.json"))
print("throughput (largest batch that fit): " + (", ".join(
  f"{k}: {v['images_per_sec']:.0f} images/s per device at batch {v['batch_per_device']}" for k, v in best.items())
  or "none"))
print(f"top-k selection: {topk_rate and f'{topk_rate:.3g}'} elements/s")
print(f"profile: {summary['profile']}\nfailed steps: {failed or 'none'}; skipped: {skipped or 'none'}")
print(json.dumps({"throughput": {k: v["images_per_sec"] for k, v in best.items()}, "topk_elements_per_sec": topk_rate,
                  "failed": failed, "skipped": skipped, "profile": summary["profile"]}))
EOF
  # Two archives: a profile too large to come back (a device machine returns files of 16 MiB at most) takes no log.
  tar czf "$OUT/logs.tar.gz.tmp" -C "$OUT" logs $(cd "$OUT" && ls train/*.json* 2> /dev/null) 2> /dev/null \
    && mv "$OUT/logs.tar.gz.tmp" "$OUT/logs.tar.gz"
  if [ -d "$OUT/train/profile" ]; then
    tar czf "$OUT/profile.tar.gz.tmp" -C "$OUT/train" profile 2> /dev/null \
      && mv "$OUT/profile.tar.gz.tmp" "$OUT/profile.tar.gz"
  fi
}

record() {  # record NAME CODE SECONDS [WHY_SKIPPED]: a line of OUT/steps.jsonl, with its log's last JSON line
  "$PY" - "$1" "$2" "$3" "$OUT/logs/$1.log" "${4:-}" >> "$OUT/steps.jsonl" <<'EOF'
import json, sys
name, code, seconds, log, skipped = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
try:
  lines = [l for l in open(log, errors="replace").read().splitlines() if l.startswith("{")]
  result = json.loads(lines[-1]) if lines else None
except (OSError, json.JSONDecodeError):
  result = None
print(json.dumps({"step": name, "exit_code": code, "seconds": seconds, "result": result,
                  **({"skipped": skipped} if skipped else {})}))
EOF
}

run() {  # run NAME SECONDS COMMAND...: its output to OUT/logs/NAME.log, a record to OUT/steps.jsonl
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if [ -n "$BUDGET" ]; then
    # 25 s kept: a step killed at its limit ends up to 10 s later (timeout -k), then the summary and the archives.
    local left=$((DEADLINE - SECONDS - 25))
    # The preflight, without which nothing runs, always gets its 30 s (the wheels' install before it takes some).
    if [ "$name" = preflight ] && [ "$left" -lt 30 ]; then left=30; fi
    if [ "$left" -lt 30 ]; then
      echo "== $name: skipped, the --budget of $BUDGET s is spent" | tee -a "$OUT/report.txt"
      record "$name" 125 0 "the --budget of $BUDGET s was spent"
      summarize > /dev/null
      return 125
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
  fi
  STEP_NAME=$name
  local shown="$*"; shown=${shown//$'\n'/ }  # a -c program on one line, cut
  [ ${#shown} -gt 160 ] && shown="${shown:0:160} ..."
  echo "== $name (at most $limit s): $shown" | tee -a "$OUT/report.txt"
  # -k: a step that does not stop at SIGTERM (in a compilation, say) is killed 10 s later.
  timeout -k 10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1 &  # waited for here, where a trapped signal ends the wait
  wait $!
  local code=$?
  STEP_NAME=
  grep -v '^{' "$OUT/logs/$name.log" | tail -n 12 >> "$OUT/report.txt"
  record "$name" "$code" "$((SECONDS - start))"
  summarize > /dev/null
  return $code
}

echo "light_jax GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  | tee -a "$OUT/report.txt"
if [ -n "$WHEELS" ]; then
  # The packages the machine lacks, into scratch; light_jax itself from this checkout: no network, nothing installed.
  if ! "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SCRATCH/site" "$WHEELS"/*.whl \
      > "$OUT/logs/wheels.log" 2>&1; then
    tail -n 5 "$OUT/logs/wheels.log" | tee -a "$OUT/report.txt" >&2
    echo "error: installing the wheels of $WHEELS failed; see $OUT/logs/wheels.log" | tee -a "$OUT/report.txt" >&2
    exit 2
  fi
  export PYTHONPATH="$SCRATCH/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
elif [ "$TOY" != "--toy" ]; then
  if ! "$PY" -m pip install --quiet -e '.[cuda]' > "$OUT/logs/pip.log" 2>&1; then
    echo "error: pip install -e '.[cuda]' failed; see $OUT/logs/pip.log (no network? then --wheels)" >&2
    exit 2
  fi
fi
if [ "$TOY" != "--toy" ]; then timeout -k 5 30 nvidia-smi > "$OUT/logs/nvidia-smi.txt" 2>&1; fi

# 0. The versions, the devices, one program on them (without which no step can run), and which of light_jax's modules
# import. A JAX whose XLA does not know a flag light_jax sets (light_jax/xla_flags.py) aborts at its start: then every
# step runs without them.
PREFLIGHT='
import importlib, importlib.metadata as metadata, json, os
from light_jax import xla_flags
xla_flags.apply()
import jax, jax.numpy as jnp
devices = jax.devices()
total = float(jax.jit(lambda a: (a @ a).sum())(jnp.ones((512, 512), jnp.bfloat16)))
versions = {}
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy"):
  try:
    versions[name] = metadata.version(name)
  except metadata.PackageNotFoundError:
    versions[name] = None
# What the steps import, each on its own: one that fails costs only the steps that need it (their logs say more).
imports = {}
for module in ("light_jax.train_step", "light_jax.parallel.collectives", "light_jax.train_lib",
               "light_jax.data.records", "light_jax.data.transforms"):
  try:
    importlib.import_module(module)
    imports[module] = "ok"
  except Exception as e:
    imports[module] = f"{type(e).__name__}: {e}"
decoder = imports["light_jax.data.transforms"] == "ok" and importlib.import_module(
  "light_jax.data.transforms").region_decoding_available()
print(json.dumps({"versions": versions, "platform": devices[0].platform, "device_kind": devices[0].device_kind,
                  "devices": len(devices), "matmul_sum": total, "xla_flags": os.environ.get("XLA_FLAGS"),
                  "imports": imports, "jpeg_region_decoder": decoder}))
'
if ! run preflight 180 "$PY" -c "$PREFLIGHT"; then
  if grep -q "Unknown flag" "$OUT/logs/preflight.log"; then
    echo "XLA refused a flag of light_jax's, so none is set from here on (LIGHT_JAX_XLA_FLAGS=0):" \
      "$(grep -m1 'Unknown flag' "$OUT/logs/preflight.log")" | tee -a "$OUT/report.txt"
    export LIGHT_JAX_XLA_FLAGS=0
    mv "$OUT/logs/preflight.log" "$OUT/logs/preflight_with_flags.log"
    sed -i 's/^{"step": "preflight",/{"step": "preflight_with_flags",/' "$OUT/steps.jsonl"  # not this step's failure
    run preflight 180 "$PY" -c "$PREFLIGHT"
  fi
  if ! grep -q '^{' "$OUT/logs/preflight.log"; then
    summarize | tee -a "$OUT/report.txt" | tail -n 1
    echo "error: light_jax cannot run here: the preflight failed; see $OUT/logs/preflight.log" >&2
    exit 1
  fi
fi
DEVICES=$(grep '^{' "$OUT/logs/preflight.log" | tail -n 1 | "$PY" -c "import json,sys; print(json.load(sys.stdin)['devices'])")

if [ "$TOY" = "--toy" ]; then
  MODEL=(--model resnet8_small --num_classes 10 --config.model.width=8 --steps 2 --warmup 1 --cpu_devices 2)
  FIRST=(float32:32); LATER=(); BATCHES=(8 4)
  COLLECTIVES=(--nodes 1 --local 2 --repeats 1 --only hitopk@0.01/mstopk --model resnet8_small)
  INPUT=(--images 20 --rounds 1 --seconds 0.2)
  UPDATE=(--model resnet18 --image 32 --batch_per_device 2 --rounds 1)
  LINKS=(--nodes 1 --local 2 --repeats 1 --max_mib 4)
  TRAIN=(--config.model.name=resnet8_small --config.model.width=8 --config.data.image_size=32
         --config.data.resolution_schedule= --config.mesh.cpu_devices=2 --config.num_epochs=3 --config.global_batch_size=16
         --config.max_steps=12 --config.data.eval_batch_size=20 --config.train.profile_steps=6:9)
  IMAGES=8
else
  MODEL=(--model resnet50 --steps 20 --warmup 3)
  FIRST=(bfloat16:224); LATER=(bfloat16:128 float16:224); BATCHES=(256 192 128 64)
  COLLECTIVES=(--nodes 1 --local -1 --repeats 5
               --only hierarchical,hitopk@0.01,hitopk@0.01/mstopk,hitopk@0.001,hitopk@0.001/mstopk,gtopk@0.01,topk@0.001,powersgd@4)
  INPUT=(--images 200 --rounds 2 --seconds 2)
  UPDATE=(--model resnet50 --batch_per_device 128 --rounds 10 --local "$DEVICES")  # sharded: >= 2 GPUs
  LINKS=(--nodes 1 --local "$DEVICES" --repeats 5 --max_mib 64)
  # ResNet-50 itself (tiny's width 16 off), in bfloat16, its decoded cache at the training size; the host's cores
  # for the input (tiny's 2 threads would hold a GPU back), no simulated CPU devices.
  TRAIN=(--config.model.name=resnet50 --config.model.width=0 --config.model.dtype=bfloat16
         --config.data.image_size=128 --config.data.cache_size=128 --config.data.resolution_schedule=
         --config.data.read_threads=16 --config.data.num_workers=8 --config.mesh.cpu_devices=0
         --config.global_batch_size=256 --config.num_epochs=20 --config.max_steps=150
         --config.train.profile_steps=100:105)
  IMAGES=300
fi

throughput() {  # throughput DTYPE:SIZE: the largest batch that fits; a smaller one only after running out of memory
  local dtype=${1%:*} size=${1#*:} batch
  for batch in "${BATCHES[@]}"; do
    run "throughput_${dtype}_${size}_b${batch}" 180 "$PY" benchmarks/throughput.py "${MODEL[@]}" \
      --image_size "$size" --batch_per_device "$batch" --dtype "$dtype" && return 0
    grep -qs "error: out of the device's memory" "$OUT/logs/throughput_${dtype}_${size}_b${batch}.log" || return 1
  done
}

for pair in "${FIRST[@]}"; do throughput "$pair"; done
run calibrate_links 120 "$PY" benchmarks/calibrate_links.py "${LINKS[@]}" --out "$OUT/links.json"
run collectives 150 "$PY" benchmarks/collectives.py "${COLLECTIVES[@]}"

# Training data: a small folder of generated JPEGs (10 classes), prepared as the README says.
DATA="$SCRATCH/data"
GENERATE='
import os, sys
import numpy as np
from tests.image_folder_fixture import class_image
root, per_class = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
for split, count in (("train", per_class), ("val", max(per_class // 10, 2))):
  for label in range(10):
    os.makedirs(f"{root}/{split}/class{label}", exist_ok=True)
    for i in range(count):
      class_image(label, rng, 160, 120).save(f"{root}/{split}/class{label}/{i}.jpg", quality=90)
'
run generate_data 120 "$PY" -c "$GENERATE" "$DATA/folder" "$IMAGES"
run prepare_data 120 "$PY" scripts/prepare_image_folder.py --folder "$DATA/folder" --out "$DATA/prepared"
run train 240 "$PY" train.py --config configs/imagenet_resnet50.py:tiny --workdir "$OUT/train" \
  --config.data.dataset=image_folder --config.data.data_dir="$DATA/prepared" --config.data.cache_dir="$DATA/cache" \
  --config.mesh.nodes=1 \
  --config.mesh.local=-1 --config.checkpoint.every_steps=0 "${TRAIN[@]}"
if [ -f "$OUT/train/summary.json" ]; then
  "$PY" -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$OUT/train/summary.json" \
    > "$OUT/train_summary.json"
fi

for pair in ${LATER[@]+"${LATER[@]}"}; do throughput "$pair"; done
run update_step 300 "$PY" benchmarks/update_step.py "${UPDATE[@]}"  # compiles ~10 programs (2 on a mesh)
run input_pipeline 90 "$PY" benchmarks/input_pipeline.py "${INPUT[@]}"

echo | tee -a "$OUT/report.txt" > /dev/null
summarize | tee -a "$OUT/report.txt" | tail -n 1
