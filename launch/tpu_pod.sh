#!/usr/bin/env bash
# Run `mhc-jax ARGS...` on every host of a Cloud TPU VM pod slice: one process per host (it
# drives that host's chips), joined by jax.distributed through the MHC_* variables.
#
#   launch/tpu_pod.sh TPU_NAME ZONE train --config configs/quickstart.yaml --out gs://BUCKET/runs/qs
#   launch/tpu_pod.sh TPU_NAME ZONE train --out gs://BUCKET/runs/qs --resume
#   launch/tpu_pod.sh TPU_NAME ZONE sweep configs/sweeps/FILE.yaml --out gs://BUCKET/sweeps/NAME
#
# Needs gcloud (logged in; PROJECT=... or a default project) and, on every worker, the
# repository at MHC_DIR (default: mhc_jax in the home directory) with a .venv holding jax[tpu]:
#   gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=all --command \
#     "git clone REPO mhc_jax && cd mhc_jax && make setup && .venv/bin/pip install 'jax[tpu]'"
# Run and sweep directories must be on storage every host sees (gs://, NFS): each host writes
# its shards of a checkpoint; only process 0 writes the logs. The coordinator is worker 0 on
# port MHC_PORT (default 8476); each worker reads its id from the TPU metadata server.
# Stopping this command (Ctrl-C) ends the remote processes; for long runs start it in tmux.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "usage: $0 TPU_NAME ZONE train|sweep ARGS..." >&2
  exit 2
fi
tpu=$1
zone=$2
shift 2
gcloud_args=(--zone "$zone")
if [[ -n ${PROJECT:-} ]]; then gcloud_args+=(--project "$PROJECT"); fi

# The workers' internal IPs, ';'-separated, worker 0 first.
ips=$(gcloud compute tpus tpu-vm describe "$tpu" "${gcloud_args[@]}" \
  --format='value(networkEndpoints[].ipAddress)')
IFS=';' read -r -a workers <<< "$ips"
if [[ ${#workers[@]} -eq 0 || -z ${workers[0]} ]]; then
  echo "$0: no workers found for TPU $tpu in $zone" >&2
  exit 2
fi

meta=http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number
remote="cd $(printf '%q' "${MHC_DIR:-mhc_jax}") && \
MHC_COORDINATOR=${workers[0]}:${MHC_PORT:-8476} MHC_NUM_PROCESSES=${#workers[@]} \
MHC_PROCESS_ID=\$(curl -sf -H Metadata-Flavor:Google $meta) \
exec .venv/bin/mhc-jax $(printf '%q ' "$@")"
exec gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$remote"
