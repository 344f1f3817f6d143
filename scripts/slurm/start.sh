#!/usr/bin/env bash
# A single-node Slurm on this machine for batchfit's Slurm engine tests (`make slurm-check`, docs/slurm.md):
# munged, slurmctld and slurmd on localhost, CPU-only, one node with this machine's CPUs and memory, no
# accounting database, no cgroups (it works in a container). Run as root; safe to run again: what already
# runs is kept. Everything it writes lives under $BATCHFIT_SLURM_STATE (default /tmp/batchfit-slurm-state),
# except /etc/slurm/slurm.conf, a link to the config there (the place sbatch, squeue and sinfo read).
set -euo pipefail

STATE="${BATCHFIT_SLURM_STATE:-/tmp/batchfit-slurm-state}"
CONF="$STATE/slurm.conf"
MARK="# written by batchfit scripts/slurm/start.sh"
WAIT_S="${BATCHFIT_SLURM_WAIT_S:-60}"

say() { echo "slurm: $*"; }
die() { echo "slurm: $*" >&2; exit 1; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] || die "installing slurm-wlm and munge needs root (apt-get)"
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
}

write_config() {
  mkdir -p "$STATE/ctld" "$STATE/d" "$STATE/log" /etc/slurm
  local node; node="$(slurmd -C | head -n1)"   # NodeName=... CPUs=... RealMemory=...: what slurmd detects here
  cat > "$CONF.new" <<CONFIG
$MARK
ClusterName=batchfit
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=600
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFIG
  mv "$CONF.new" "$CONF"
  if [ -e /etc/slurm/slurm.conf ] && ! grep -qF "$MARK" /etc/slurm/slurm.conf; then
    die "/etc/slurm/slurm.conf exists and is not ours: move it away first"
  fi
  ln -sfn "$CONF" /etc/slurm/slurm.conf
}

running() {  # running PIDFILE: whether the daemon that wrote PIDFILE still runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating a munge key"
    if command -v mungekey >/dev/null; then mungekey --create --force; \
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if ! running /run/munge/munged.pid; then
    say "starting munged"
    runuser -u munge -- munged
  fi
}

start_slurm() {
  if ! running "$STATE/slurmctld.pid"; then say "starting slurmctld"; slurmctld; fi
  if ! running "$STATE/slurmd.pid"; then say "starting slurmd"; slurmd; fi
}

wait_idle() {  # until sinfo shows the node idle (or mixed/allocated: it runs jobs), resuming it when down
  local node state waited=0
  node="$(hostname -s)"
  while [ "$waited" -lt "$WAIT_S" ]; do
    state="$(sinfo -h -N -n "$node" -o %T 2>/dev/null | head -n1 || true)"
    case "$state" in
      idle|mixed|allocated|completing) say "node $node is $state"; return ;;
      down*|drain*|fail*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1; waited=$((waited + 1))
  done
  die "node $node is '${state:-unknown}' after ${WAIT_S}s: see $STATE/log/"
}

install_packages
write_config
start_munge
start_slurm
wait_idle
