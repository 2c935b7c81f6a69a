#!/usr/bin/env bash
# bench_gpu.py on a lent GPU machine (no network): install the carried wheels, then run it once.
#
#   bash benchmarks/bench_gpu.sh [bench_gpu.py options]     # from the checkout's root, .gpu/ carried
#
# .gpu/whl holds the wheels built on the CPU machine by ../shared/gpu/build_wheels.sh (third-party
# packages the GPU image lacks, Ray repacked, and the project's own wheels at the commit measured:
# the `mineonline` command and the plugins' entry points come from them); benchmarks/RESULTS.md
# (issue 24) says how to build them. JSON lines go to stdout and to $OUT/bench_gpu.jsonl.
# Knobs (env): GPU_WHL (.gpu/whl), GPU_SITE (/tmp/mineonline_site), GPU_PYTHON (python3), OUT (.gpu/out).
set -u
WHL=${GPU_WHL:-.gpu/whl}
SITE=${GPU_SITE:-/tmp/mineonline_site}
PY=${GPU_PYTHON:-python3}
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
if compgen -G "$WHL/*.whl" >/dev/null; then
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHL"/*.whl || exit 1
  rm -rf "$SITE/tests"  # opensimplex ships a top-level `tests` package that would shadow the project's
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
else
  echo "bench_gpu.sh: no wheels in $WHL; using the Python environment as it is" >&2
fi
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 WANDB_MODE=disabled
exec "$PY" benchmarks/bench_gpu.py --out "$OUT/bench_gpu.jsonl" "$@"
