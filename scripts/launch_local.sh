#!/usr/bin/env bash
# Start N local `jaxmp train` processes that form one multi-process JAX run on this machine.
#
#   scripts/launch_local.sh N [jaxmp train args...]
#   scripts/launch_local.sh 2 --set train.steps=20 --set mesh.data=2 --set mesh.fsdp=4
#
# Every process runs on CPU with DEVICES_PER_PROCESS simulated devices (default 8/N when N
# divides 8, else 1) and gloo collectives; process 0 hosts the coordinator on 127.0.0.1 at a
# free port (or $PORT). This is the same code path as N hosts with one process each: the mesh
# is laid out over processes (jaxmp.mesh), each process reads only its rows of every batch,
# only process 0 prints progress and writes metrics, and every process writes its checkpoint
# shards into the shared --run-dir.
#
# Output lines are prefixed with "[i] " (process index); gloo's "Rank r is connected to k
# peer ranks" notices are dropped. The script waits for all processes and exits 0 when all
# succeed. When one fails it stops the others (SIGTERM, SIGKILL after 5 s) and exits with the
# failed process's code. Ctrl-C (or SIGTERM to this script) sends SIGTERM to every process,
# which JAX's preemption service turns into "save a checkpoint at the same step and stop";
# a second Ctrl-C kills them at once. Environment: DEVICES_PER_PROCESS, PORT, PYTHON.
set -u

usage() {
    echo "usage: $0 N [jaxmp train args...]  (N >= 1 local processes)" >&2
    exit 2
}
[ $# -ge 1 ] || usage
case "$1" in ''|*[!0-9]*) usage ;; esac
N=$1
shift
[ "$N" -ge 1 ] || usage
[ "${1:-}" = "train" ] && shift  # accept `launch_local.sh 2 train ...` too

if [ -z "${DEVICES_PER_PROCESS:-}" ]; then
    if [ "$N" -le 8 ] && [ $((8 % N)) -eq 0 ]; then DEVICES_PER_PROCESS=$((8 / N)); else DEVICES_PER_PROCESS=1; fi
fi
case "$DEVICES_PER_PROCESS" in ''|*[!0-9]*|0) echo "$0: DEVICES_PER_PROCESS must be a positive integer" >&2; exit 2 ;; esac

PYTHON=${PYTHON:-$(command -v python || command -v python3)}
[ -n "$PYTHON" ] || { echo "$0: no python found (set PYTHON)" >&2; exit 2; }
# Run this checkout's jaxmp even when it is not installed.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # lines reach the prefixer as they are printed

if [ -z "${PORT:-}" ]; then
    PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') \
        || { echo "$0: could not find a free port (set PORT)" >&2; exit 1; }
fi
echo "launch_local: $N processes x $DEVICES_PER_PROCESS CPU devices, coordinator 127.0.0.1:$PORT" >&2

pids=()
# SIGTERM first, which a healthy run treats as preemption: every process saves a checkpoint at
# the same step and exits. A process that is stuck (its peer died) or ignores it gets SIGKILL
# after $1 seconds.
stop_all() {
    local grace=$1 pid alive t
    for pid in ${pids[@]+"${pids[@]}"}; do
        kill -TERM -- "-$pid" 2>/dev/null
    done
    for ((t = 0; t < grace * 10; t++)); do
        alive=0
        for pid in ${pids[@]+"${pids[@]}"}; do
            kill -0 -- "-$pid" 2>/dev/null && alive=1
        done
        [ "$alive" -eq 0 ] && return
        sleep 0.1
    done
    kill_all
}
kill_all() {
    local pid
    for pid in ${pids[@]+"${pids[@]}"}; do
        kill -KILL -- "-$pid" 2>/dev/null
    done
}
interrupted=0
on_signal() {
    if [ "$interrupted" -eq 1 ]; then  # a second Ctrl-C: no more waiting
        kill_all
        exit 130
    fi
    interrupted=1
    echo "launch_local: interrupted; stopping all processes (again to kill them at once)" >&2
    stop_all 60
    wait
    exit 130
}
trap on_signal INT TERM

# Prefix each line with "[i] " as it arrives (a shell loop: awk may buffer its input). It
# ignores INT/TERM and ends when its process closes the pipe, so no output is ever cut off.
prefix() {
    trap '' INT TERM
    local line
    while IFS= read -r line || [ -n "$line" ]; do
        case $line in *"is connected to "*" peer ranks"*) continue ;; esac  # gloo chatter
        printf '[%s] %s\n' "$1" "$line"
    done
}

# Each process gets its own process group (set -m): Ctrl-C reaches only this script, which
# then stops them all. $! is the python process itself, so `wait` returns its exit code.
set -m
for ((i = 0; i < N; i++)); do
    "$PYTHON" -m jaxmp.cli train "$@" \
        --simulate-devices "$DEVICES_PER_PROCESS" \
        --coordinator "127.0.0.1:$PORT" --num-processes "$N" --process-id "$i" \
        > >(prefix "$i") 2>&1 &
    pids+=("$!")
done
set +m  # no job notices from bash

# Poll instead of `wait -n` (bash 3.2 on macOS has none): the first failure stops the rest.
status=0
running=$N
declare -a done_=()
while [ "$running" -gt 0 ]; do
    for ((i = 0; i < N; i++)); do
        [ -n "${done_[$i]:-}" ] && continue
        kill -0 "${pids[$i]}" 2>/dev/null && continue
        wait "${pids[$i]}" 2>/dev/null  # the exit code says it; no "Killed ..." job notice
        rc=$?
        done_[$i]=1
        running=$((running - 1))
        if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
            status=$rc
            echo "launch_local: process $i exited with code $rc; stopping the others" >&2
            stop_all 5
        fi
    done
    [ "$running" -gt 0 ] && sleep 0.2
done
wait  # the prefixers print the last lines
exit "$status"
