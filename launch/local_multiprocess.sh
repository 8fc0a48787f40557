#!/usr/bin/env bash
# Start N local mhc-jax processes under jax.distributed (coordinator on 127.0.0.1) and wait
# for all of them: a multi-host run on one machine, e.g. to check one on the CPU.
#
#   launch/local_multiprocess.sh 2 train --config configs/debug.yaml --out runs/mp
#   MHC_DEVICES_PER_PROCESS=4 launch/local_multiprocess.sh 2 train --config configs/quickstart.yaml
#
# The arguments after N are passed to every process's `mhc-jax`; each process gets
# MHC_COORDINATOR, MHC_NUM_PROCESSES and MHC_PROCESS_ID (read by config.resolve_dist).
# Environment:
#   MHC_PORT                 coordinator port (default: a free one)
#   MHC_DEVICES_PER_PROCESS  simulated CPU devices per process (default 1; with JAX_PLATFORMS=cpu)
#   JAX_PLATFORMS            default cpu (CPU collectives then use gloo)
#   MHC_JAX                  the command to run (default: mhc-jax)
#   MHC_KILL_AFTER           seconds the others get to stop after one fails (default 30)
# Exit status: 0 when every process exits 0, else the first failure's. When one fails the
# others get SIGTERM (then SIGKILL), since they would wait for it forever. SIGINT and SIGTERM
# are passed on (on SIGTERM each process saves a checkpoint and exits 143). Needs bash >= 4.3.
set -euo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N ARGS...   (e.g. $0 2 train --config configs/debug.yaml)" >&2
  exit 2
fi
n=$1
shift

free_port='import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
port=${MHC_PORT:-$(python3 -c "$free_port")}
export MHC_COORDINATOR="127.0.0.1:$port" MHC_NUM_PROCESSES="$n"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
if [[ $JAX_PLATFORMS == cpu ]]; then
  flags=$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<< "${XLA_FLAGS:-}")
  export XLA_FLAGS="$flags --xla_force_host_platform_device_count=${MHC_DEVICES_PER_PROCESS:-1}"
fi
read -r -a cmd <<< "${MHC_JAX:-mhc-jax}"

pids=()
killer=""
send() { kill -"$1" "${pids[@]}" 2>/dev/null || true; }
trap 'send TERM' TERM
trap 'send INT' INT
for ((i = 0; i < n; i++)); do
  MHC_PROCESS_ID=$i "${cmd[@]}" "$@" &
  pids+=("$!")
done

status=0
for ((i = 0; i < n; i++)); do
  rc=0
  wait -n || rc=$?  # the next process to finish (or a trapped signal, already passed on)
  if ((rc == 127)); then break; fi  # none left
  if ((rc != 0 && status == 0)); then
    status=$rc
    send TERM
    { sleep "${MHC_KILL_AFTER:-30}"; send KILL; } &
    killer=$!
    disown "$killer"
  fi
done
wait || true  # any still running after a signal
if [[ -n $killer ]]; then kill "$killer" 2>/dev/null || true; fi
exit "$status"
