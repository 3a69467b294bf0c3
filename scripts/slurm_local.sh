#!/usr/bin/env bash
# A working one-machine Slurm cluster, for running the workflow's cases as Slurm jobs
# (workflow/profiles/slurm-local; docs/workflow.md, "Slurm"). Debian's packages, as root:
#
#   bash scripts/slurm_local.sh install   apt-get install slurmctld, slurmd, slurm-client,
#                                         slurmdbd, munge and mariadb-server (once)
#   bash scripts/slurm_local.sh start     install if needed, then start munged, mariadbd,
#                                         slurmdbd, slurmctld and slurmd on localhost and run
#                                         one job through them; again: checks, starts nothing
#   bash scripts/slurm_local.sh status    the daemons and the node
#   bash scripts/slurm_local.sh stop      stop the daemons (and their jobs), remove the state
#
# One partition, `local`, with this machine's CPUs and memory as `slurmd -C` sees them, and its
# GPUs as the gres `gpu` where `nvidia-smi -L` lists any. Job accounting is on (slurmdbd over a
# MariaDB of its own): the Snakemake executor plugin learns from `sacct` that a job ended.
#
# Everything `start` makes (configs, munge key, database, spool, logs, pid files, sockets) lives
# in $SLAPO_SLURM_DIR (default /var/lib/slapo-slurm), and `stop` removes exactly that folder
# and the one thing start puts outside it: /etc/slurm/slurm.conf, a link to the cluster's
# slurm.conf, where clients look by default. A link and not SLURM_CONF alone, as the Snakemake
# plugin's job step (snakemake-executor-plugin-slurm-jobstep 0.6.1) drops SLURM_CONF from the
# environment of the `srun` it runs inside each job. A machine whose /etc/slurm/slurm.conf is
# its own has a cluster already: start refuses it (exit 3). The daemons listen on ports
# $SLAPO_SLURM_PORT (default 6817: slurmctld), +1 (slurmd), +2 (slurmdbd). The packages stay
# installed; their own services are not used.
#
# Exit status: 0 done; 1 failed (the log lines say which daemon and why); 3 this machine cannot
# run it (not root, or no apt-get and no Slurm installed): callers such as .ci/run skip on 3.
set -euo pipefail

DIR=${SLAPO_SLURM_DIR:-/var/lib/slapo-slurm}
PORT=${SLAPO_SLURM_PORT:-6817}
CLUSTER=slapo-local
PARTITION=local
ACCOUNT=slapo
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
BINARIES=(slurmctld slurmd slurmdbd sbatch sacct sacctmgr munged mariadbd mariadb-install-db)
MARKER=$DIR/.slapo-slurm  # stop removes $DIR only where start left this
export SLURM_CONF=$DIR/etc/slurm.conf
DEFAULT_CONF=/etc/slurm/slurm.conf  # where Debian's Slurm clients look without SLURM_CONF
# slurmdbd reaches MariaDB through this socket (no TCP port to collide with another server)
export MYSQL_UNIX_PORT=$DIR/run/mysqld.sock
PATH=$PATH:/usr/sbin:/sbin

say() { echo "slurm_local: $*" >&2; }
die() { say "error: $*"; exit 1; }
cannot() { say "cannot run here: $*"; exit 3; }

installed() {
  local b
  for b in "${BINARIES[@]}"; do command -v "$b" >/dev/null || return 1; done
}

install_packages() {
  installed && return 0
  [[ $(id -u) == 0 ]] || cannot "Slurm is not installed and installing it needs root"
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get"
  say "installing ${PACKAGES[*]} (Debian packages)"
  # Keep the packages' own services from starting (they would look for /etc/slurm/slurm.conf
  # and take the default ports and MariaDB socket): a policy-rc.d refusing every start, for the
  # length of the install only, unless the machine has one already (containers often do).
  local policy=/usr/sbin/policy-rc.d made_policy=
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${PACKAGES[@]}" >"${TMPDIR:-/tmp}/slurm_local.apt.log" 2>&1 ||
    { apt-get update -q >>"${TMPDIR:-/tmp}/slurm_local.apt.log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${PACKAGES[@]}" >>"${TMPDIR:-/tmp}/slurm_local.apt.log" 2>&1; }; } || rc=$?
  [[ -n $made_policy ]] && rm -f "$policy"
  if (( rc != 0 )); then
    tail -20 "${TMPDIR:-/tmp}/slurm_local.apt.log" >&2
    cannot "apt-get install failed (log: ${TMPDIR:-/tmp}/slurm_local.apt.log)"
  fi
  installed || die "installed ${PACKAGES[*]}, yet one of ${BINARIES[*]} is missing"
}

# ------------------------------------------------------------------------------- daemons

alive() {  # alive PIDFILE: the process the pid file names is running
  local pid
  [[ -s $1 ]] && pid=$(<"$1") && [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null
}

wait_for() {  # wait_for SECONDS DAEMON COMMAND...: poll until COMMAND succeeds
  local seconds=$1 what=$2 pidfile=$DIR/run/$2.pid end=$((SECONDS + $1))
  shift 2
  while ((SECONDS < end)); do
    "$@" >/dev/null 2>&1 && return 0
    # a daemon that wrote its pid file and died will not come up: say so now
    if [[ -s $pidfile ]] && ! alive "$pidfile"; then break; fi
    sleep 0.5
  done
  say "$what did not come up within ${seconds}s; its log:"
  tail -25 "$DIR/log/$what.log" "$DIR/munge/$what.log" 2>/dev/null >&2 || true
  return 1
}

gpu_count() {  # the GPUs nvidia-smi lists; nothing where there are none
  local n
  n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  [[ ${n:-0} != 0 ]] && echo "$n"
  return 0
}

node_line() {  # this machine as slurmd sees it, with its GPUs as gres
  local line
  line=$(slurmd -C | head -1)
  [[ $line == NodeName=* ]] || die "slurmd -C gave no node line: $line"
  # CPUs and memory exactly as slurmd will report them (a node reporting less is drained)
  line=${line#NodeName=* }
  echo "NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE $line${1:+ Gres=gpu:$1}" \
    "State=UNKNOWN"
}

write_configs() {  # each file once: a second start keeps them (and the database password)
  local gpus
  gpus=$(gpu_count)
  [[ -s $SLURM_CONF ]] || write_slurm_conf "$gpus"
  if [[ -n $gpus && ! -s $DIR/etc/gres.conf ]]; then
    echo "Name=gpu File=/dev/nvidia[0-$((gpus - 1))]" >"$DIR/etc/gres.conf"
  fi
  [[ -s $DIR/etc/slurmdbd.conf ]] || write_slurmdbd_conf
}

write_slurm_conf() {  # write_slurm_conf GPUS
  local nodes
  nodes=$(node_line "$1")
  cat >"$SLURM_CONF" <<EOF
# A one-machine cluster made by scripts/slurm_local.sh; all its state is under $DIR.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=$SLURM_USER
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/spool/slurmctld
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# no cgroups in a container: track processes by their parents, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# the cluster's accounting: the Snakemake plugin asks sacct whether a job has ended
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
# for slurmdbd this names the munge socket (clients and slurmctld reach slurmdbd through it)
AccountingStoragePass=$DIR/munge/munge.socket
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
${1:+GresTypes=gpu}
$nodes
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

write_slurmdbd_conf() {
  # slurmdbd.conf holds the database password: its owner alone may read it (slurmdbd insists)
  local pass
  pass=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
  (umask 077 && cat >"$DIR/etc/slurmdbd.conf" <<EOF
DbdHost=$NODE
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=$SLURM_USER
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
  )
  chown "$SLURM_USER" "$DIR/etc/slurmdbd.conf"
}

start_munge() {
  alive "$DIR/run/munged.pid" && return 0
  [[ -s $DIR/munge/munge.key ]] ||
    (umask 077 && dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none)
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munge.seed" || die "munged did not start (log: $DIR/munge/munged.log)"
  wait_for 20 munged bash -c "munge -n -S '$DIR/munge/munge.socket' | unmunge -S \
    '$DIR/munge/munge.socket'"
}

db() { mariadb --no-defaults --socket="$MYSQL_UNIX_PORT" -uroot "$@"; }

start_mariadb() {
  if ! alive "$DIR/run/mariadbd.pid"; then
    if [[ ! -d $DIR/mysql/mysql ]]; then
      mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=mysql \
        --auth-root-authentication-method=socket --skip-test-db \
        >"$DIR/log/mariadb-install.log" 2>&1 ||
        { tail -20 "$DIR/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
    fi
    # no TCP port; small buffers (a test cluster's accounting is tiny); Slurm's advised
    # lock wait
    setsid mariadbd --no-defaults --datadir="$DIR/mysql" --user=mysql --skip-networking \
      --socket="$MYSQL_UNIX_PORT" --pid-file="$DIR/run/mariadbd.pid" \
      --log-error="$DIR/log/mariadbd.log" --innodb-buffer-pool-size=64M \
      --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
      </dev/null >/dev/null 2>&1 &
  fi
  wait_for 60 mariadbd db -e 'select 1'
  local pass
  pass=$(sed -n 's/^StoragePass=//p' "$DIR/etc/slurmdbd.conf")
  db -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost';
            ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
    die "could not create the database user of slurmdbd"
}

start_slurmdbd() {
  if ! alive "$DIR/run/slurmdbd.pid"; then
    slurmdbd || die "slurmdbd did not start (log: $DIR/log/slurmdbd.log)"
  fi
  wait_for 60 slurmdbd sacctmgr -n list cluster
  # the cluster, an account and this user in it: sacct, and the plugin's account check, work
  if [[ -z $(sacctmgr -n -P list cluster "$CLUSTER" format=cluster) ]]; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed"
  fi
  if [[ -z $(sacctmgr -n -P list account "$ACCOUNT" format=account) ]]; then
    sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" \
      description="slapo-ae local cluster" organization=slapo-ae >/dev/null ||
      die "sacctmgr add account failed"
  fi
  local user
  for user in $(id -un) ${SUDO_USER:-}; do
    if [[ -z $(sacctmgr -n -P list assoc user="$user" account="$ACCOUNT" format=user) ]]; then
      sacctmgr -i add user "$user" account="$ACCOUNT" cluster="$CLUSTER" >/dev/null ||
        die "sacctmgr add user $user failed"
    fi
  done
}

node_idle() { sinfo -h -n "$NODE" -o %t | grep -qE '^(idle|mix|alloc)'; }

start_slurm() {
  alive "$DIR/run/slurmctld.pid" || slurmctld ||
    die "slurmctld did not start (log: $DIR/log/slurmctld.log)"
  wait_for 60 slurmctld scontrol ping
  alive "$DIR/run/slurmd.pid" || slurmd -N "$NODE" ||
    die "slurmd did not start (log: $DIR/log/slurmd.log)"
  if ! wait_for 60 slurmd node_idle; then
    scontrol show node "$NODE" >&2 || true
    die "node $NODE is not idle"
  fi
}

smoke_job() {  # one job through the cluster, and its end in the accounting
  local id state i
  id=$(sbatch --parsable -p "$PARTITION" -A "$ACCOUNT" -J slapo-smoke -n 1 --mem 100 -t 1 \
    -o /dev/null --wait --wrap true) || die "the smoke job failed (sbatch --wait)"
  for ((i = 0; i < 120; i++)); do
    state=$(sacct -n -X -P -j "$id" -o State 2>/dev/null | head -1)
    [[ $state == COMPLETED ]] && { say "job $id ran and sacct says COMPLETED"; return 0; }
    sleep 0.25
  done
  die "job $id ended but sacct says '${state:-nothing}' after 30 s"
}

ours() { [[ -L $DEFAULT_CONF && $(readlink "$DEFAULT_CONF") == "$SLURM_CONF" ]]; }

start() {
  [[ $(id -u) == 0 ]] || cannot "starting slurmd and the others needs root"
  install_packages
  if [[ -e $DEFAULT_CONF || -L $DEFAULT_CONF ]] && ! ours; then
    cannot "$DEFAULT_CONF exists: this machine has a Slurm configuration of its own"
  fi
  NODE=$(hostname -s)
  SLURM_USER=$(id -un slurm 2>/dev/null || id -un)
  mkdir -p "$DIR"
  touch "$MARKER"
  mkdir -p "$DIR"/{etc,run,log,munge,spool/slurmd}
  install -d -o "$SLURM_USER" "$DIR/spool/slurmctld"
  install -d -o mysql "$DIR/mysql"
  # logs: the folder root's (munged refuses one that others own), each file its daemon's user
  local name
  for name in slurmctld slurmd slurmdbd; do touch "$DIR/log/$name.log"; done
  chown "$SLURM_USER" "$DIR/log/slurmctld.log" "$DIR/log/slurmdbd.log"
  touch "$DIR/log/mariadbd.log" && chown mysql "$DIR/log/mariadbd.log"
  chown mysql "$DIR/run"  # mariadbd writes its socket and pid file here as user mysql
  chmod 755 "$DIR" "$DIR/run" "$DIR/munge"
  write_configs
  mkdir -p "$(dirname "$DEFAULT_CONF")"
  ours || ln -s "$SLURM_CONF" "$DEFAULT_CONF"
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurm
  smoke_job
  say "cluster $CLUSTER is up: partition $PARTITION, account $ACCOUNT; state in $DIR"
}

stop_pid() {  # stop_pid NAME: TERM the daemon, KILL it after 30 s
  local file=$DIR/run/$1.pid pid i
  alive "$file" || return 0
  pid=$(<"$file")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 120; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.25
  done
  say "$1 (pid $pid) ignored SIGTERM for 30 s; killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  if [[ ! -d $DIR ]]; then
    if ours; then rm -f "$DEFAULT_CONF"; fi  # left by a start that got no further
    say "nothing to stop: no $DIR"
    return 0
  fi
  [[ -e $MARKER ]] || die "$DIR was not made by this script (no $MARKER); not touching it"
  if alive "$DIR/run/slurmctld.pid"; then
    squeue -h -o %A | xargs -r scancel --full 2>/dev/null || true
  fi
  local name
  for name in slurmd slurmctld slurmdbd mariadbd munged; do stop_pid "$name"; done
  local removed_link=
  if ours; then rm -f "$DEFAULT_CONF"; removed_link=" and the link $DEFAULT_CONF"; fi
  rm -rf "$DIR"
  say "stopped; removed $DIR${removed_link:-}"
}

status() {
  local name rc=0
  for name in munged mariadbd slurmdbd slurmctld slurmd; do
    if alive "$DIR/run/$name.pid"; then echo "$name: running (pid $(<"$DIR/run/$name.pid"))"
    else echo "$name: not running"; rc=1; fi
  done
  if (( rc == 0 )); then sinfo -N -o '%N %P %t %c %m %G'; fi
  return $rc
}

case ${1:-} in
  install) install_packages ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2 ;;
esac
