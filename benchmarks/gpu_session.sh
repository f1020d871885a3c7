#!/usr/bin/env bash
# The GPU checks of one device call, prepared: a session lent a GPU (15 minutes of device time, a few of
# them spent starting the machine) runs this once instead of composing commands on the clock.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh          # every step: lane attention int4
#   GPU_SESSION_STEPS="lane int4" OUT=... bash benchmarks/gpu_session.sh
#   GPU_SESSION_SMOKE=1 OUT=/tmp/x bash benchmarks/gpu_session.sh   # on CPU: checks this script itself
#
# Steps, each under its own time limit (seconds, GPU_SESSION_<STEP>_S), so that one slow step cannot eat
# the others' time; their logs, tables and plots go to $OUT (8 files, what the device tool returns at most):
#   lane       `pytest -m gpu`: every Pallas kernel compiled, the cuDNN bridge, decode (limit 200 s)
#   attention  benchmarks/attention_gpu.py with GPU_SESSION_ATTENTION_ARGS (default: head dim 128,
#              L 4k/16k, fwd and fwd+bwd, decode at 16k; `--quick` is ~8 minutes alone) (limit 200 s)
#   int4       benchmarks/int4_gpu.py with GPU_SESSION_INT4_ARGS (default: its own M and shapes)
#              (limit 150 s)
# The step summaries and the markdown tables are printed last, so that they are in the tail of the
# output the device tool returns even where the files are not fetched. Exit status: 0 when every step
# that ran exited 0.
set -u
: "${OUT:?set OUT to the folder for the logs (the device tool sets it)}"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
STEPS=${GPU_SESSION_STEPS:-lane attention int4}
SMOKE=${GPU_SESSION_SMOKE:-}
for s in $STEPS; do  # checked before any step runs
  case $s in
    lane | attention | int4) ;;
    *)
      echo "gpu_session.sh: unknown step '$s' in GPU_SESSION_STEPS (expected: lane, attention, int4)" >&2
      exit 2
      ;;
  esac
done
mkdir -p "$OUT"

summary=()
failed=0

# step NAME LIMIT_S COMMAND...: runs COMMAND under LIMIT_S seconds (SIGINT first, SIGKILL 10 s later),
# its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local note=""
  [ "$rc" -eq 124 ] && note=" (hit its ${limit} s limit)"
  summary+=("$name: exit $rc after $((SECONDS - t0)) s$note")
  [ "$rc" -eq 0 ] || failed=1
}

{
  date -u
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  "$PY" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', jaxlib.__version__, '|', jax.devices())"
  "$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| available', torch.cuda.is_available())" 2>&1 | tail -1
  git log --oneline -1 2>/dev/null || true
} >"$OUT/env.txt" 2>&1

for s in $STEPS; do
  case $s in
    lane)
      if [ -n "$SMOKE" ]; then  # no GPU: every test of the lane's file is skipped, the invocation is checked
        step lane "${GPU_SESSION_LANE_S:-200}" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
          tests/attention/test_gpu_lane.py
      else
        step lane "${GPU_SESSION_LANE_S:-200}" env JAX_PLATFORMS=cuda,cpu "$PY" -m pytest -m gpu -q -rs \
          -p no:cacheprovider tests
      fi
      ;;
    attention)
      args=${GPU_SESSION_ATTENTION_ARGS:---head-dims 128 --lengths 4096 16384 --decode-lengths 16384}
      [ -n "$SMOKE" ] && args=--smoke
      # shellcheck disable=SC2086  # the arguments are meant to split
      step attention_gpu "${GPU_SESSION_ATTENTION_S:-200}" "$PY" benchmarks/attention_gpu.py $args \
        --md "$OUT/attention_gpu.md" --png "$OUT/attention_gpu.png"
      ;;
    int4)
      args=${GPU_SESSION_INT4_ARGS:-}
      [ -n "$SMOKE" ] && args=--smoke
      # shellcheck disable=SC2086
      step int4_gpu "${GPU_SESSION_INT4_S:-150}" "$PY" benchmarks/int4_gpu.py $args \
        --md "$OUT/int4_gpu.md" --png "$OUT/int4_gpu.png"
      ;;
  esac
done

cat "$OUT/env.txt"
for s in $STEPS; do
  case $s in
    lane) log=lane ;;
    *) log=${s}_gpu ;;
  esac
  echo "---- $log.log (last lines)"
  tail -n 8 "$OUT/$log.log"
  [ -f "$OUT/$log.md" ] && { echo "---- $log.md"; cat "$OUT/$log.md"; }
done
echo "---- steps"
printf '%s\n' "${summary[@]}"
exit "$failed"
