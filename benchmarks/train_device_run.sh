#!/usr/bin/env bash
# Training runs longer than one device call (10 minutes at most): `start` launches a run in its own process
# session, which outlives the call while the machine stays held; `wait` follows it; `collect` copies results
# to $OUT (emptied before every call, hence the runs live in /tmp/runs).
# Usage (device machine, repo root, after `bash benchmarks/cuda_device_run.sh build`):
#   bash benchmarks/train_device_run.sh start NAME [train_wikitext103.py args...]
#   bash benchmarks/train_device_run.sh wait NAME SECONDS
#   bash benchmarks/train_device_run.sh collect NAME...
# NPROC=N before `start`: the run goes through `torchrun --standalone --nproc-per-node N` (one GPU a process).
RUNS=/tmp/runs; OUT=${OUT:-/tmp/out}; mkdir -p "$RUNS" "$OUT"
cmd=$1; shift
case "$cmd" in
  start)
    name=$1; shift
    [ "$(id -u)" = 0 ] || echo "warning: not root, the run may be ended when this call returns"
    PYTHONUNBUFFERED=1 setsid bash -c 'echo $$ > "$0.pid"
      exec python3 ${NPROC:+-m torch.distributed.run --standalone --nproc-per-node $NPROC} examples/train_wikitext103.py "$@"' \
      "$RUNS/$name" "$@" --no-progress --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1 < /dev/null &
    sleep 2; echo "started $name (pid $(cat "$RUNS/$name.pid")): $*" ;;
  wait)
    name=$1; deadline=$((SECONDS + $2)); pid=$(cat "$RUNS/$name.pid")
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 5; done
    if kill -0 "$pid" 2>/dev/null; then echo "$name: still running"; else echo "$name: finished"; fi
    tail -4 "$RUNS/$name.log" ;;
  collect)
    for name in "$@"; do cp -r "$RUNS/$name" "$RUNS/$name.log" "$OUT/"; done ;;
  *) echo "unknown command $cmd"; exit 2 ;;
esac
