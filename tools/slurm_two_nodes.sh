#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, each node in a network namespace of its own, for
# testing the multi-node paths of slurm/ (tests/test_slurm_two_nodes.py).
#
#   tools/slurm_two_nodes.sh start    # network, private munged, slurmctld, two slurmd; waits for idle
#   tools/slurm_two_nodes.sh status   # exit 0 only when both nodes take jobs
#   tools/slurm_two_nodes.sh stop     # stop what start started, delete namespaces and bridge
#   tools/slurm_two_nodes.sh env      # the SLURM_CONF line clients need
#
# Layout (all on virtual interfaces of this machine; the namespaces have no default route, so
# nothing leaves the private /24): a bridge $PREFIX-br0 at $NET.1 in the root namespace, where
# slurmctld and a private munged run; nodes node1 ($NET.11) and node2 ($NET.12), each a network
# namespace $PREFIX-n1/$PREFIX-n2 with a slurmd, its own hostname and its own /etc/hosts. Each
# node has 2 CPUs and 2 fake GPUs (character devices behind Gres=gpu:2, so that Slurm sets
# CUDA_VISIBLE_DEVICES; a CPU build of torch ignores them).
#
# Nothing is shared with another Slurm or munge on the host: own ports, own munge socket and key,
# own state folder; clients must export SLURM_CONF=$STATE/etc/slurm.conf. Requeued jobs start
# again within seconds (cred_expire=10, bf_interval=2; Slurm's defaults hold them ~2 minutes).
# slurmd runs under `nsenter --net` + `unshare --mount --uts`, not `ip netns exec`, which remounts
# /sys and hides the cgroup tree slurmd 22.05 needs.
#
# Environment: SLURM2_DIR (state, default /tmp/mrl-slurm2), SLURM2_NET (a /24 prefix, default
# 10.231.8), SLURM2_PREFIX (interface and namespace names, default mrl), SLURM2_CTLD_PORT /
# SLURM2_SLURMD_PORT (default 6927 / 6928).
# Exit codes: 0 ok; 1 usage; 3 this machine cannot make the cluster (not root, no network
# namespaces, a daemon that did not come up: the reason is the last line).
set -uo pipefail

STATE=${SLURM2_DIR:-/tmp/mrl-slurm2}
NET=${SLURM2_NET:-10.231.8}
PREFIX=${SLURM2_PREFIX:-mrl}
CTLD_PORT=${SLURM2_CTLD_PORT:-6927}
SLURMD_PORT=${SLURM2_SLURMD_PORT:-6928}
BRIDGE=$PREFIX-br0
NODES=(node1 node2)
MSOCK=$STATE/munge/munge.socket
CONF=$STATE/etc/slurm.conf
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge iproute2)
export SLURM_CONF=$CONF

log() { printf 'slurm_two_nodes %(%T)T: %s\n' -1 "$*" >&2; }
cannot() {
    local f
    for f in "$STATE"/log/*.log "$STATE"/munge/munged.log; do
        [[ -s $f ]] && { log "--- $f"; tail -n 5 "$f" >&2; }
    done
    stop >/dev/null 2>&1
    log "cannot start here: $*"
    exit 3
}

# shellcheck source=tools/slurm_daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/slurm_daemons.sh"

make_network() {
    local i ns
    ip link add "$BRIDGE" type bridge 2>/dev/null || cannot "ip link add $BRIDGE type bridge failed"
    if ! { ip addr add "$NET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up; }; then
        cannot "bridge address"
    fi
    for i in 1 2; do
        ns=$PREFIX-n$i
        ip netns add "$ns" 2>/dev/null || cannot "ip netns add $ns failed (no network namespaces)"
        ip link add "$PREFIX-v$i" type veth peer name eth0 netns "$ns" || cannot "veth pair"
        ip link set "$PREFIX-v$i" master "$BRIDGE" && ip link set "$PREFIX-v$i" up
        ip -n "$ns" addr add "$NET.1$i/24" dev eth0
        if ! { ip -n "$ns" link set lo up && ip -n "$ns" link set eth0 up; }; then
            cannot "namespace links"
        fi
        mkdir -p "$STATE/hosts"
        printf '127.0.0.1\tlocalhost\n%s.1\tslurm2ctl %s\n%s.11\tnode1\n%s.12\tnode2\n' \
            "$NET" "$(hostname -s)" "$NET" "$NET" >"$STATE/hosts/node$i"
    done
}

start_munge() {
    install -d -o munge -g munge -m 0755 "$STATE/munge"
    install -d -o munge -g munge -m 0700 "$STATE/munge/key"
    runuser -u munge -- mungekey --create --keyfile="$STATE/munge/key/munge.key" >/dev/null 2>&1 \
        || cannot "mungekey failed"
    runuser -u munge -- /usr/sbin/munged --socket="$MSOCK" \
        --key-file="$STATE/munge/key/munge.key" --pid-file="$STATE/munge/munged.pid" \
        --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed" \
        || cannot "munged did not start"
    for _ in $(seq 200); do
        munge -n -S "$MSOCK" 2>/dev/null | unmunge -S "$MSOCK" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    cannot "munged does not answer on $MSOCK"
}

write_config() {
    local n g
    install -d -m 0755 "$STATE/etc" "$STATE/log" "$STATE/run" "$STATE/spool/slurmctld"
    for n in "${NODES[@]}"; do
        install -d -m 0755 "$STATE/gpus/$n"
        for g in 0 1; do mknod -m 0666 "$STATE/gpus/$n/nvidia$g" c 1 3 || cannot "mknod"; done
        printf 'NodeName=%s Name=gpu File=%s/gpus/%s/nvidia[0-1]\n' "$n" "$STATE" "$n"
    done >"$STATE/etc/gres.conf"
    cat >"$CONF" <<EOF
ClusterName=mrl2
SlurmctldHost=$(hostname -s)($NET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MSOCK,cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=2
GresTypes=gpu
ReturnToService=2
JobRequeue=1
StateSaveLocation=$STATE/spool/slurmctld
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=4
NodeName=node1 NodeAddr=$NET.11 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
NodeName=node2 NodeAddr=$NET.12 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 Gres=gpu:2 State=UNKNOWN
PartitionName=p Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
}

both_idle() {
    [[ $(sinfo -h -N -o '%N %T' 2>/dev/null | sort | tr '\n' ' ') == "node1 idle node2 idle " ]]
}

start() {
    ((EUID == 0)) || cannot "needs root (network namespaces, daemons)"
    # sinfo waits a minute for a controller that is not there: ask only when its pid is alive.
    if pid_alive "$STATE/run/slurmctld.pid" && both_idle; then
        log "already running"
        return 0
    fi
    stop >/dev/null 2>&1
    install_packages "${PACKAGES[@]}" || cannot "Slurm's packages are missing"
    mkdir -p "$STATE"
    log "network"
    make_network
    log "munge"
    start_munge
    write_config
    log "slurmctld"
    slurmctld || cannot "slurmctld did not start ($STATE/log/slurmctld.log)"
    for _ in $(seq 300); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
    local i
    log "slurmd"
    for i in 1 2; do
        nsenter --net="/run/netns/$PREFIX-n$i" unshare --mount --uts sh -c \
            "mount --bind '$STATE/hosts/node$i' /etc/hosts && hostname node$i && exec slurmd -N node$i" \
            || cannot "slurmd node$i did not start ($STATE/log/slurmd-node$i.log)"
    done
    local t0=$SECONDS
    # Generous: beside a test run on 2 busy cores the daemons register slowly.
    for _ in $(seq 360); do both_idle && break; sleep 0.5; done
    log "nodes idle after $((SECONDS - t0)) s"
    both_idle || cannot "nodes not idle after 180 s: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"
    log "up: node1 $NET.11, node2 $NET.12; clients: export SLURM_CONF=$CONF"
}

stop() {
    local i ns pids
    stop_pid "$STATE/run/slurmd-node1.pid"
    stop_pid "$STATE/run/slurmd-node2.pid"
    stop_pid "$STATE/run/slurmctld.pid"
    for i in 1 2; do
        ns=$PREFIX-n$i
        ip netns list 2>/dev/null | grep -qw "$ns" || continue
        # Whatever a test left in a node (job steps, Ray daemons) goes with it.
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
        if [[ -n ${pids// /} ]]; then
            # shellcheck disable=SC2086  # a list of pids
            kill -TERM $pids 2>/dev/null
            sleep 2
            pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
            # shellcheck disable=SC2086
            [[ -n ${pids// /} ]] && kill -KILL $pids 2>/dev/null
        fi
        ip netns del "$ns"
    done
    ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
    stop_pid "$STATE/munge/munged.pid"
    rm -rf "$STATE"
    log "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) pid_alive "$STATE/run/slurmctld.pid" && both_idle ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|status|stop|env" >&2; exit 1 ;;
esac
