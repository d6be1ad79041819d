#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for the tests (tests/test_slurm.py) and for trying the launch path
# by hand (docs/clusters.md). Run as root: it installs Debian packages and starts daemons.
#
#   scripts/launch/local_slurm.sh install  apt-get install slurm-wlm and munge if they are missing
#   scripts/launch/local_slurm.sh up       install if missing, write a one-node slurm.conf under $JAXLLM_SLURM_DIR,
#                                          start munged, slurmctld and slurmd, and wait until the node is idle.
#                                          A cluster that already answers (ours, or the machine's own with
#                                          /etc/slurm/slurm.conf) is reused. Last line: `SLURM_CONF=<file> started`
#                                          or `... reused`: clients (sbatch, squeue, scripts/submit.py) need that
#                                          SLURM_CONF in their environment.
#   scripts/launch/local_slurm.sh down     stop the daemons `up` started (their pid files), nothing else
#
# The node declares 8 CPUs whatever the machine has (SlurmdParameters=config_overrides), so a 2-task job of 4 fake
# JAX devices a task and a job beside it fit; three partitions share it as priority tiers (low < normal < high:
# SLURM schedules a higher tier's pending jobs first, no accounting database needed).
set -euo pipefail

STATE=${JAXLLM_SLURM_DIR:-/tmp/jaxllm-slurm}
CONF=$STATE/slurm.conf
NODE_CPUS=8

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
      && command -v sbatch >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: SLURM is not installed and installing it (apt-get) needs root" >&2; exit 1
  fi
  echo "installing slurm-wlm and munge (apt-get)" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >&2
}

answers() {  # whether the cluster of SLURM_CONF=$1 answers with a usable node
  SLURM_CONF=$1 timeout 10 sinfo -h -N -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'
}

write_conf() {
  local host
  host=$(hostname -s)
  mkdir -p "$STATE/ctld" "$STATE/d"
  cat >"$CONF" <<EOF
# One-node cluster of scripts/launch/local_slurm.sh (written $(date -u +%FT%TZ)).
ClusterName=jaxllm
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (SLURM default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Pending jobs are looked at every 2 s (default 60 s), so a requeued or freed-up job starts within seconds.
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host CPUs=$NODE_CPUS State=UNKNOWN
PartitionName=low Nodes=$host PriorityTier=1 MaxTime=INFINITE State=UP
PartitionName=normal Nodes=$host PriorityTier=2 MaxTime=INFINITE State=UP Default=YES
PartitionName=high Nodes=$host PriorityTier=3 MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0
  fi
  [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
  chown munge:munge /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  echo munged >>"$STATE/started"
}

up() {
  install_packages
  if [ -f "$CONF" ] && answers "$CONF"; then
    echo "SLURM_CONF=$CONF reused"; return 0
  fi
  if [ -f /etc/slurm/slurm.conf ] && answers /etc/slurm/slurm.conf; then
    echo "SLURM_CONF=/etc/slurm/slurm.conf reused"; return 0
  fi
  [ "$(id -u)" -eq 0 ] || { echo "error: starting a SLURM cluster needs root" >&2; exit 1; }
  mkdir -p "$STATE"
  : >"$STATE/started"
  write_conf
  start_munge
  /usr/sbin/slurmctld -c -f "$CONF"
  echo slurmctld >>"$STATE/started"
  /usr/sbin/slurmd -c -f "$CONF"
  echo slurmd >>"$STATE/started"
  for _ in $(seq 120); do
    if answers "$CONF"; then
      echo "SLURM_CONF=$CONF started"; return 0
    fi
    sleep 0.5
  done
  echo "error: the local SLURM node did not become idle in 60 s; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
  exit 1
}

down() {
  [ -f "$STATE/started" ] || return 0
  local daemon pid
  for daemon in slurmd slurmctld; do
    if grep -qx "$daemon" "$STATE/started" && [ -f "$STATE/$daemon.pid" ]; then
      pid=$(cat "$STATE/$daemon.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  done
  if grep -qx munged "$STATE/started"; then
    pkill -u munge -x munged || true
  fi
  rm -f "$STATE/started"
}

case "${1:-}" in
  install) install_packages ;;
  up) up ;;
  down) down ;;
  *) echo "usage: $0 install|up|down" >&2; exit 2 ;;
esac
