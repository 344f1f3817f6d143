#!/usr/bin/env bash
# Stops what scripts/slurm/start.sh started (slurmd, slurmctld, munged), each by the pid it wrote; with
# --purge also removes its state folder and its /etc/slurm/slurm.conf link. Safe to run again.
set -euo pipefail

STATE="${BATCHFIT_SLURM_STATE:-/tmp/batchfit-slurm-state}"

stop() {  # stop NAME PIDFILE: SIGTERM, then wait up to 10 s for the process to end
  local pid
  [ -s "$2" ] || return 0
  pid="$(cat "$2")"
  kill -0 "$pid" 2>/dev/null || return 0
  echo "slurm: stopping $1 ($pid)"
  kill "$pid"
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  echo "slurm: $1 ($pid) still runs" >&2
}

stop slurmd "$STATE/slurmd.pid"
stop slurmctld "$STATE/slurmctld.pid"
stop munged /run/munge/munged.pid
if [ "${1:-}" = "--purge" ]; then
  if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$STATE/slurm.conf" ]; then
    rm /etc/slurm/slurm.conf
  fi
  rm -rf "$STATE"
fi
