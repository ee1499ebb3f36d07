#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine (Debian's Slurm 22.05; root).
#
#   tools/local_slurm.sh start  [BASE]   install (apt) what is missing, write BASE/etc/slurm.conf,
#                                        start slurmctld + one slurmd per node, wait until idle
#   tools/local_slurm.sh status [BASE]   the daemons and `sinfo`
#   tools/local_slurm.sh stop   [BASE]   cancel jobs, stop every daemon by its PID file
#
# Then `export SLURM_CONF=BASE/etc/slurm.conf` (or `source BASE/env.sh`) and use sbatch/srun.
# Every node n1..nN is its own slurmd with its own port and its own loopback address 127.0.1.i
# (all nodes share this host's name), spool, TmpFS and log. Auth is auth/none (no munge daemon).
#
# Knobs: LOCAL_SLURM_NODES=2  LOCAL_SLURM_CPUS=2 (per node; may exceed real cores)
#        LOCAL_SLURM_PORT=17817 (slurmctld; slurmd i listens on PORT+100+i)
#        LOCAL_SLURM_CRED_EXPIRE=5 (also the delay before a requeued job starts again)
set -euo pipefail

CMD=${1:-}
BASE=${2:-/tmp/agent-r1-slurm}
case "$BASE" in /*) ;; *) BASE="$(pwd)/$BASE" ;; esac
NODES=${LOCAL_SLURM_NODES:-2}
CPUS=${LOCAL_SLURM_CPUS:-2}
PORT=${LOCAL_SLURM_PORT:-17817}
CRED_EXPIRE=${LOCAL_SLURM_CRED_EXPIRE:-5}
CONF=$BASE/etc/slurm.conf
export SLURM_CONF=$CONF

say() { printf '[local_slurm] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# pid_alive FILE: the pid in FILE runs and was started with our config
pid_alive() {
  local p
  [ -s "$1" ] || return 1
  p=$(tr -dc '0-9' <"$1")
  [ -n "$p" ] && [ -r "/proc/$p/cmdline" ] && tr '\0' ' ' <"/proc/$p/cmdline" | grep -qF -- "$CONF" &&
    ! grep -q '^State:.*Z' "/proc/$p/status" 2>/dev/null
}

install_packages() {
  # libpmix-dev: slurm's mpi/pmix plugin dlopen()s .../pmix2/lib/libpmix.so, which only the -dev
  # package has; without it `srun --mpi=pmix` hangs. Open MPI for mpi4py under srun.
  local pkgs=(slurmctld slurmd slurm-client libpmix2 libpmix-dev openmpi-bin libopenmpi-dev) missing=() p
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "need root to apt-get install ${missing[*]}"
  say "installing ${missing[*]}"
  local policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then # no package may start system daemons
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ "$policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

write_conf() {
  local host mem i
  host=$(hostname -s)
  mem=$(($(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo) / NODES))
  mkdir -p "$BASE"/{etc,state,log,run,spool,tmp}
  for i in $(seq 1 "$NODES"); do mkdir -p "$BASE/spool/n$i" "$BASE/tmp/n$i"; done
  cat >"$CONF.new" <<EOF
# agent-r1 local cluster ($BASE), written by tools/local_slurm.sh
ClusterName=agentr1
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=$CRED_EXPIRE
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
TmpFS=$BASE/tmp/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=5,bf_interval=1
EnforcePartLimits=ALL
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
EOF
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.1.$i Port=$((PORT + 100 + i)) CPUs=$CPUS RealMemory=$mem State=UNKNOWN" >>"$CONF.new"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF.new"
  if pid_alive "$BASE/run/slurmctld.pid" && ! cmp -s "$CONF.new" "$CONF"; then
    rm -f "$CONF.new"
    die "a cluster with another config runs in $BASE: stop it first"
  fi
  mv "$CONF.new" "$CONF"
  echo "export SLURM_CONF=$CONF" >"$BASE/env.sh"
}

idle_nodes() { sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2=="idle"' | sort -u | wc -l; }

start() {
  install_packages
  write_conf
  if ! pid_alive "$BASE/run/slurmctld.pid"; then
    rm -rf "$BASE/state"/* "$BASE/log"/*
    slurmctld -f "$CONF" -i </dev/null >>"$BASE/log/start.log" 2>&1
  fi
  local i
  for i in $(seq 1 "$NODES"); do
    pid_alive "$BASE/run/slurmd-n$i.pid" || slurmd -f "$CONF" -N "n$i" </dev/null >>"$BASE/log/start.log" 2>&1
  done
  local end=$(($(date +%s) + 90))
  until [ "$(idle_nodes)" -ge "$NODES" ]; do
    if [ "$(date +%s)" -ge "$end" ]; then
      tail -n 20 "$BASE"/log/*.log >&2 || true
      die "nodes not idle after 90 s"
    fi
    sleep 0.2
  done
  say "cluster up in $BASE: $NODES nodes x $CPUS CPUs (SLURM_CONF=$CONF)"
}

status() {
  local f
  for f in "$BASE"/run/*.pid; do
    [ -e "$f" ] || continue
    if pid_alive "$f"; then echo "$(basename "$f" .pid): running ($(cat "$f"))"; else echo "$(basename "$f" .pid): stopped"; fi
  done
  pid_alive "$BASE/run/slurmctld.pid" && sinfo
  return 0
}

stop() {
  [ -f "$CONF" ] || { say "no cluster in $BASE"; return 0; }
  local f p end
  if pid_alive "$BASE/run/slurmctld.pid"; then # jobs first: slurmd does not kill running steps
    scancel --user=root 2>/dev/null || true
    end=$(($(date +%s) + 15))
    while [ -n "$(squeue -h 2>/dev/null)" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
  fi
  for f in "$BASE"/run/slurmd-*.pid "$BASE/run/slurmctld.pid"; do
    [ -e "$f" ] || continue
    if pid_alive "$f"; then
      p=$(tr -dc '0-9' <"$f")
      kill -TERM "$p" 2>/dev/null || true
      end=$(($(date +%s) + 15))
      while pid_alive "$f" && [ "$(date +%s)" -lt "$end" ]; do sleep 0.1; done
      pid_alive "$f" && kill -KILL "$p" 2>/dev/null || true
    fi
  done
  # job processes whose slurmstepd outlived its slurmd (identified by our SLURM_CONF, never by name)
  for p in $(grep -lszxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
    [ "$p" = "$$" ] && continue
    grep -qz '^SLURM_JOB_ID=' "/proc/$p/environ" 2>/dev/null || [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmstepd ] || continue
    kill -KILL "$p" 2>/dev/null || true
  done
  say "stopped the cluster in $BASE"
}

case "$CMD" in
start) start ;;
stop) stop ;;
status) status ;;
*) die "usage: $0 start|stop|status [BASE]" ;;
esac
