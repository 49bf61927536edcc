#!/usr/bin/env bash
# A real, single-node Slurm cluster on this machine, for testing the sbatch scripts in slurm/.
#
#   tools/slurm_local.sh start    # install (if missing) and start munged, slurmctld, slurmd
#   tools/slurm_local.sh status   # daemons, node state; exit 0 only when the node takes jobs
#   tools/slurm_local.sh stop     # stop the daemons this script started (by their pid files)
#
# It uses Debian's slurm-wlm 22.05 and munge (installed with apt-get when missing, which needs
# root) and runs the daemons directly, without systemd. The node is `localhost` with this
# machine's CPUs and memory, and with `Gres=gpu:8` backed by eight plain files, so that scripts
# asking for `--gpus-per-node=8` are scheduled on a CPU-only machine (the "GPUs" are not real:
# CUDA_VISIBLE_DEVICES is set, a CPU build of torch ignores it).
#
# All Slurm state (config, spool, logs, pid files, fake GPU files) lives in
# ${SLURM_LOCAL_DIR:-/tmp/slurm-local}. The config is written to $SLURM_LOCAL_DIR/etc/slurm.conf
# and, if /etc/slurm/slurm.conf does not exist, linked there so that plain `sbatch` finds it;
# otherwise export SLURM_CONF=$SLURM_LOCAL_DIR/etc/slurm.conf (`status` prints the line).
# Munge uses the system paths (/etc/munge/munge.key, /run/munge).
#
# Environment: SLURM_LOCAL_DIR (state folder), SLURM_LOCAL_GPUS (fake GPUs, default 8),
# SLURM_LOCAL_CTLD_PORT / SLURM_LOCAL_SLURMD_PORT (default 6817 / 6818),
# SLURM_LOCAL_TIMEOUT (seconds to wait for the node, default 60).
#
# Exit codes: 0 ok; 1 usage or setup error; 3 the cluster cannot start here (not root, or a daemon
# did not come up: its log tail is printed).
set -euo pipefail

STATE=${SLURM_LOCAL_DIR:-/tmp/slurm-local}
GPUS=${SLURM_LOCAL_GPUS:-8}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
CONF=$STATE/etc/slurm.conf
SYSTEM_CONF=/etc/slurm/slurm.conf
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge)
EXIT_DAEMON=3

export SLURM_CONF=$CONF

log() { printf 'slurm_local: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=tools/slurm_daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_daemons.sh"

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then
        return 0
    fi
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0600 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
    touch "$STATE/run/munged.ours"
    local _
    for _ in $(seq 50); do
        munge_works && return 0
        sleep 0.1
    done
    log "munged did not answer"
    tail -n 20 /var/log/munge/munged.log >&2 2>/dev/null || true
    exit "$EXIT_DAEMON"
}

# The hardware line of `slurmd -C` (CPUs, sockets, cores, threads), renamed to localhost, with a
# RealMemory a little under the real one so the node is never drained for "low memory".
node_line() {
    local hw mem_mb
    hw=$(slurmd -C | head -n1)
    hw=${hw#NodeName=* }
    hw=$(sed -E 's/ ?RealMemory=[0-9]+//' <<<"$hw")
    mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    printf 'NodeName=localhost NodeAddr=127.0.0.1 %s RealMemory=%s Gres=gpu:%s State=UNKNOWN\n' \
        "$hw" "$mem_mb" "$GPUS"
}

write_config() {
    install -d -m 0755 "$STATE" "$STATE/etc" "$STATE/log" "$STATE/run" "$STATE/gpus"
    install -d -m 0755 "$STATE/spool/slurmctld" "$STATE/spool/slurmd"
    local i last=$((GPUS - 1))
    for ((i = 0; i < GPUS; i++)); do
        touch "$STATE/gpus/nvidia$i"
    done
    cat >"$CONF.new" <<EOF
# Written by tools/slurm_local.sh: a single-node test cluster. Do not edit; rerun start.
ClusterName=local
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
StateSaveLocation=$STATE/spool/slurmctld
SlurmdSpoolDir=$STATE/spool/slurmd
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
# sbatch --wait polls every 2 s only while MinJobAge < 8 (it backs off to 32 s otherwise).
MinJobAge=4
$(node_line)
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.new" "$CONF"
    printf 'NodeName=localhost Name=gpu File=%s/gpus/nvidia[0-%s]\n' "$STATE" "$last" \
        >"$STATE/etc/gres.conf"
    # Slurm reads gres.conf next to slurm.conf; link both into /etc/slurm when that is free.
    if [[ ! -e $SYSTEM_CONF || $(readlink "$SYSTEM_CONF" || true) == "$CONF" ]]; then
        install -d -m 0755 /etc/slurm
        ln -sfn "$CONF" "$SYSTEM_CONF"
        ln -sfn "$STATE/etc/gres.conf" /etc/slurm/gres.conf
    fi
}

node_state() { sinfo -h -n localhost -o %T 2>/dev/null | head -n1; }

daemon_failed() {
    log "$1 did not come up; last lines of its log:"
    tail -n 30 "$STATE/log/$1.log" >&2 2>/dev/null || true
    exit "$EXIT_DAEMON"
}

start() {
    if ((EUID != 0)); then
        log "the daemons run as root here (SlurmUser=root); run start as root"
        exit "$EXIT_DAEMON"
    fi
    install_packages "${PACKAGES[@]}" || die "cannot install Slurm's packages"
    install -d -m 0755 "$STATE/run"
    start_munge
    if pid_alive "$STATE/run/slurmctld.pid" && pid_alive "$STATE/run/slurmd.pid"; then
        log "already running"
    else
        stop_slurm
        write_config
        slurmctld || daemon_failed slurmctld
        local _
        for _ in $(seq 100); do
            scontrol ping 2>/dev/null | grep -q 'is UP' && break
            sleep 0.1
        done
        scontrol ping 2>/dev/null | grep -q 'is UP' || daemon_failed slurmctld
        slurmd -N localhost || daemon_failed slurmd
    fi
    local deadline=$((SECONDS + TIMEOUT)) state=""
    while ((SECONDS < deadline)); do
        state=$(node_state)
        case $state in
            idle* | mixed* | allocated* | completing*) break ;;
            down* | drain*) scontrol update NodeName=localhost State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    case $state in
        idle* | mixed* | allocated* | completing*) ;;
        *)
            log "node state is '${state:-unknown}' after ${TIMEOUT}s"
            scontrol show node localhost >&2 2>/dev/null || true
            daemon_failed slurmd
            ;;
    esac
    log "up: node localhost is $state (SLURM_CONF=$CONF)"
}

stop_slurm() {
    stop_pid "$STATE/run/slurmd.pid"
    stop_pid "$STATE/run/slurmctld.pid"
}

stop() {
    stop_slurm
    if [[ -e $STATE/run/munged.ours ]]; then
        stop_pid /run/munge/munged.pid
        rm -f "$STATE/run/munged.ours"
    fi
    log "stopped"
}

status() {
    local ok=0 name
    for name in slurmctld slurmd; do
        if pid_alive "$STATE/run/$name.pid"; then
            printf '%-10s running (pid %s)\n' "$name" "$(<"$STATE/run/$name.pid")"
        else
            printf '%-10s stopped\n' "$name"
            ok=1
        fi
    done
    if munge_works; then
        printf '%-10s running\n' munged
    else
        printf '%-10s stopped\n' munged
        ok=1
    fi
    if ((ok == 0)); then
        local state
        state=$(node_state)
        printf '%-10s %s\n' node "${state:-unknown}"
        case $state in idle* | mixed* | allocated* | completing*) ;; *) ok=1 ;; esac
    fi
    printf 'export SLURM_CONF=%s\n' "$CONF"
    return "$ok"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *)
        echo "usage: $0 start|stop|status" >&2
        exit 1
        ;;
esac
