#!/usr/bin/env bash
# The GPU checks of one device call, prepared: a session lent a GPU (15 minutes of device time, a few of
# them spent starting the machine) runs this once instead of composing commands on the clock.
#
#   OUT=gpu_out bash benchmarks/gpu_session.sh             # every step: lane attention int4
#   GPU_SESSION_STEPS="lane int4" OUT=... bash benchmarks/gpu_session.sh
#   GPU_SESSION_SMOKE=1 OUT=gpu_out bash benchmarks/gpu_session.sh  # on CPU: checks this script itself
#
# Steps, each under its own time limit (seconds, GPU_SESSION_<STEP>_S), and all of them under one total
# (GPU_SESSION_TOTAL_S, default 520: a step gets at most what is left of it), so that one slow step cannot
# eat the others' time nor the call run into the device tool's 600 s limit; their logs, tables and plots
# go to $OUT (8 files, what the device tool returns at most). Measured on an H200 (2026-11-26): the lane
# took 264 s with 8 workers, the attention step 95 s, the int4 step 97 s. Within a 15-minute device
# budget, two calls fit best: GPU_SESSION_STEPS=lane, then "attention int4 tune" while the machine is
# warm, with GPU_SESSION_TOTAL_S at most what `status` says is left minus a minute.
#   lane       `pytest -m gpu` over tests/: every Pallas kernel compiled, the cuDNN bridge, decode
#              (limit 300 s, 12 workers; each test's result printed as it ends, so a cut-off run
#              keeps them; GPU_SESSION_LANE_ARGS: more pytest arguments, e.g. "-k Mosaic" or
#              --deselect ids of cases already run: the Mosaic GPU cases alone need ~8 minutes)
#   attention  benchmarks/attention_gpu.py with GPU_SESSION_ATTENTION_ARGS (default: head dim 128,
#              L 4k/16k, fwd and fwd+bwd, the softcap / segment ids / dropout rows, decode at 16k; `--quick` is
#              ~8 minutes alone) (limit 170 s)
#   int4       benchmarks/int4_gpu.py with GPU_SESSION_INT4_ARGS (default: its own M and shapes)
#              (limit 130 s)
#   tune       benchmarks/tune_gpu.py with GPU_SESSION_TUNE_ARGS (default: --budget-s 170): the Pallas
#              kernels' default configs (the Mosaic GPU flash kernels first, on sm90) against the
#              fastest of their search spaces (limit 210 s; not in the default steps; its table goes
#              to its log, so that the second call's "attention int4 tune" stays within the 8 files)
# A limit sends SIGINT (the benchmarks then write the rows they finished), SIGKILL 10 s later: a compile
# does not return to Python within that, so the benchmarks also rewrite their table after every row and
# print each row (tune: each config's time) to their log as it ends; a kill keeps all of those. The step
# summaries and the markdown tables are printed last, so that they are in the tail of the output the
# device tool returns even where the files are not fetched. Exit status: 0 when every step exited 0,
# 1 when one did not, 2 for bad settings.
set -u
: "${OUT:?set OUT to the folder for the logs (the device tool sets it)}"
STEPS=${GPU_SESSION_STEPS-lane attention int4}
SMOKE=${GPU_SESSION_SMOKE:-}
read -r -a steps <<<"$STEPS"
if [ "${#steps[@]}" -eq 0 ]; then
  echo "gpu_session.sh: GPU_SESSION_STEPS names no step (expected some of: lane attention int4 tune)" >&2
  exit 2
fi
for s in "${steps[@]}"; do  # checked before any step runs
  case $s in
    lane | attention | int4 | tune) ;;
    *)
      echo "gpu_session.sh: unknown step '$s' in GPU_SESSION_STEPS (expected: lane, attention, int4, tune)" >&2
      exit 2
      ;;
  esac
done
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd) || exit 2  # absolute: the steps run from the repository root
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python3 || command -v python)}  # the GPU image's python3 holds torch
# On CPU (smoke) the lane's tests all skip and the benchmarks take their --smoke shapes: the commands are
# the real ones otherwise, so that a typo in them fails the smoke test too.
if [ -n "$SMOKE" ]; then PLATFORMS=cpu; else PLATFORMS=cuda,cpu; fi
DEADLINE=$((SECONDS + ${GPU_SESSION_TOTAL_S:-520}))

summary=()
failed=0

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, the time left of the total), its output
# in $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 5 ]; then
    summary+=("$name: not run (the ${GPU_SESSION_TOTAL_S:-520} s total is spent)")
    failed=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local note=""
  case $rc in
    124 | 137) note=" (hit its ${limit} s limit)" ;;
  esac
  summary+=("$name: exit $rc after $((SECONDS - t0)) s$note")
  [ "$rc" -eq 0 ] || failed=1
}

{
  date -u
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  timeout 60 env JAX_PLATFORMS=$PLATFORMS "$PY" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', jaxlib.__version__, '|', jax.devices())"
  timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available())" 2>&1 | tail -1
  git log --oneline -1 2>/dev/null || true
} >"$OUT/env.txt" 2>&1

set -f  # the *_ARGS below split on spaces, without glob expansion
for s in "${steps[@]}"; do
  case $s in
    lane)
      # Compiling the Triton kernels dominates the lane: pytest-xdist workers (GPU_SESSION_LANE_WORKERS,
      # default 12; 0 for one process) compile in parallel on the host's cores and share the GPU, each
      # without JAX's up-front grab of 75% of its memory.
      workers=()
      w=${GPU_SESSION_LANE_WORKERS:-12}
      if [ -z "$SMOKE" ] && [ "$w" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then workers=(-n "$w"); fi
      step lane "${GPU_SESSION_LANE_S:-300}" env JAX_PLATFORMS=$PLATFORMS XLA_PYTHON_CLIENT_PREALLOCATE=false \
        "$PY" -m pytest -m gpu -v --tb=short -rfEs -p no:cacheprovider -p no:benchmark ${workers[@]+"${workers[@]}"} \
        ${GPU_SESSION_LANE_ARGS:-} tests
      ;;
    attention)
      args=${GPU_SESSION_ATTENTION_ARGS:---head-dims 128 --lengths 4096 16384 --decode-lengths 16384}
      [ -n "$SMOKE" ] && args="$args --smoke"
      # shellcheck disable=SC2086  # the arguments are meant to split
      step attention_gpu "${GPU_SESSION_ATTENTION_S:-170}" env JAX_PLATFORMS=$PLATFORMS "$PY" \
        benchmarks/attention_gpu.py $args --md "$OUT/attention_gpu.md" --png "$OUT/attention_gpu.png"
      ;;
    int4)
      args=${GPU_SESSION_INT4_ARGS:-}
      [ -n "$SMOKE" ] && args="$args --smoke"
      # shellcheck disable=SC2086
      step int4_gpu "${GPU_SESSION_INT4_S:-130}" env JAX_PLATFORMS=$PLATFORMS "$PY" \
        benchmarks/int4_gpu.py $args --md "$OUT/int4_gpu.md" --png "$OUT/int4_gpu.png"
      ;;
    tune)
      args=${GPU_SESSION_TUNE_ARGS:---budget-s 170}
      [ -n "$SMOKE" ] && args="$args --smoke"
      # shellcheck disable=SC2086
      step tune_gpu "${GPU_SESSION_TUNE_S:-210}" env JAX_PLATFORMS=$PLATFORMS "$PY" benchmarks/tune_gpu.py $args
      ;;
  esac
done
set +f

cat "$OUT/env.txt"
for s in "${steps[@]}"; do
  case $s in
    lane) log=lane ;;
    *) log=${s}_gpu ;;
  esac
  if [ -f "$OUT/$log.md" ]; then
    echo "---- $log.md"
    cat "$OUT/$log.md"
  elif [ "$s" = tune ]; then
    if grep -q '^Pallas kernel configs' "$OUT/$log.log" 2>/dev/null; then
      echo "---- $log.log (its table)"
      sed -n '/^Pallas kernel configs/,$p' "$OUT/$log.log"
    else  # killed before its table: the rows it printed as they ended
      echo "---- $log.log (its rows; no table: the step was cut short)"
      grep '^  row: ' "$OUT/$log.log" 2>/dev/null
    fi
  else
    echo "---- $log.log (last lines)"
    tail -n 12 "$OUT/$log.log" 2>/dev/null
  fi
done
echo "---- steps"
printf '%s\n' "${summary[@]}"
exit "$failed"
