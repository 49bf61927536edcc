# shellcheck shell=bash
# Launch functions shared by the batch scripts of slurm/ (sourced, never run on its own).
#
#   rlhf_init TAG          checks, repository and Python, the attempt's log folder, the container
#   rlhf_srun LABEL [srun options] -- COMMAND...
#                          one job step in the background, through the container when one is set;
#                          its pid in RLHF_LAST_PID, its label kept for rlhf_supervise
#   rlhf_run [srun options] -- COMMAND...   one step in the foreground (short checks)
#   rlhf_check_config JOB ARGS...   the CLI's --check-only on the head node, before anything starts
#   rlhf_drive LABEL [srun options] -- COMMAND...   the driver step, to its end; a service
#                          step (Ray) ending first ends the job; USR1/TERM reach the driver as a
#                          clean stop at a step boundary
#   rlhf_ray_cluster GPUS CPUS PORT WAIT_S   Ray over the job's nodes with token authentication
#   rlhf_ranks_job JOB     train-rm / sft with one rank per task
#   rlhf_finish RC         exit code policy: 0 finished, 75 stopped to be resumed (requeued while
#                          SLURM_RESTART_COUNT < MAX_RESTARTS), anything else failed (never requeued)
#
# Environment read here (each script's header lists its own):
#   REPO_DIR, VENV, PYTHON   where the code is (inside the container with CONTAINER_IMAGE: the
#                          image's /opt/megatron_rlhf and its python, unless given)
#   CONTAINER_IMAGE        run every step in this image: pyxis (srun --container-image) or, with
#                          CONTAINER_RUNTIME=apptainer, `apptainer exec --nv IMAGE`
#   CONTAINER_MOUNTS       extra mounts, pyxis syntax (SRC:DST[,SRC:DST...]); the log root is added
#   LOG_ROOT               attempt folders go under it (default: the submission folder's slurm-logs)
#   MAX_RESTARTS           requeues after a clean stop (default 3)
#   DRY_RUN=1              print every srun line instead of running it (needs SLURM_JOB_ID,
#                          SLURM_JOB_NODELIST and SLURM_JOB_NUM_NODES in the environment)

EXIT_STOPPED=75  # the trainers' "stopped at a step boundary, resume with the same command"
declare -gA RLHF_STEPS=()  # pid -> label of every background step
RLHF_LAST_PID=""
RLHF_STOP_SIGNAL=""

rlhf_log() { printf '[%s] %s\n' "$RLHF_TAG" "$*"; }
rlhf_die() { printf '[%s] error: %s\n' "$RLHF_TAG" "$*" >&2; exit 2; }

# Slurm's node-list syntax (gpu[01-03,07],login1), one name a line: scontrol in a job, this
# expander under DRY_RUN (no Slurm needed; one bracket group per name).
rlhf_hostnames() {
    local list=$1 part="" c i depth=0 parts=() prefix ranges suffix r lo hi n
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        scontrol show hostnames "$list"
        return
    fi
    for ((i = 0; i < ${#list}; i++)); do
        c=${list:i:1}
        [[ $c == "[" ]] && ((depth += 1))
        [[ $c == "]" ]] && ((depth -= 1))
        if [[ $c == "," && $depth == 0 ]]; then parts+=("$part"); part=""; else part+=$c; fi
    done
    parts+=("$part")
    for part in "${parts[@]}"; do
        if [[ $part =~ ^([^[]*)\[([^]]*)\](.*)$ ]]; then
            prefix=${BASH_REMATCH[1]} ranges=${BASH_REMATCH[2]} suffix=${BASH_REMATCH[3]}
            IFS=, read -ra r <<<"$ranges"
            for n in "${r[@]}"; do
                if [[ $n =~ ^([0-9]+)-([0-9]+)$ ]]; then
                    lo=${BASH_REMATCH[1]} hi=${BASH_REMATCH[2]}
                    for ((i = 10#$lo; i <= 10#$hi; i++)); do
                        printf '%s%0*d%s\n' "$prefix" "${#lo}" "$i" "$suffix"
                    done
                else
                    printf '%s%s%s\n' "$prefix" "$n" "$suffix"
                fi
            done
        else
            printf '%s\n' "$part"
        fi
    done
}

_rlhf_check_image() {
    local image=$CONTAINER_IMAGE
    case "${CONTAINER_RUNTIME:-pyxis}" in
        pyxis)
            # A squashfs file or a path must exist; a registry reference is pulled by pyxis.
            if [[ $image == /* || $image == ./* || $image == *.sqsh ]] && [[ ! -f $image ]]; then
                rlhf_die "CONTAINER_IMAGE=$image does not exist"
            fi ;;
        apptainer)
            if [[ $image != *://* && ! -e $image ]]; then
                rlhf_die "CONTAINER_IMAGE=$image does not exist (a .sif file or a docker:// URI)"
            fi
            [[ ${DRY_RUN:-0} == 1 ]] || command -v apptainer >/dev/null \
                || rlhf_die "CONTAINER_RUNTIME=apptainer but no apptainer on this node" ;;
        *) rlhf_die "CONTAINER_RUNTIME=${CONTAINER_RUNTIME} is not pyxis or apptainer" ;;
    esac
}

rlhf_init() {
    RLHF_TAG=$1
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        : "${SLURM_JOB_ID:?DRY_RUN=1 needs SLURM_JOB_ID in the environment}"
        : "${SLURM_JOB_NODELIST:?DRY_RUN=1 needs SLURM_JOB_NODELIST in the environment}"
        : "${SLURM_JOB_NUM_NODES:?DRY_RUN=1 needs SLURM_JOB_NUM_NODES in the environment}"
    else
        : "${SLURM_JOB_ID:?submit this script with sbatch (or set DRY_RUN=1)}"
    fi
    RLHF_RESTART=${SLURM_RESTART_COUNT:-0}
    MAX_RESTARTS=${MAX_RESTARTS:-3}
    [[ $MAX_RESTARTS =~ ^[0-9]+$ ]] || rlhf_die "MAX_RESTARTS=$MAX_RESTARTS is not a count"
    LOG_ROOT=$(realpath -m "${LOG_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}/slurm-logs}")
    RLHF_ATTEMPT_DIR=$LOG_ROOT/$SLURM_JOB_ID-$RLHF_RESTART
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        _rlhf_check_image
        # Paths resolve inside the image: its copy of the repository and its Python.
        REPO_DIR=${REPO_DIR:-/opt/megatron_rlhf}
        PYTHON=${PYTHON:-python}
        CONTAINER_MOUNTS=${CONTAINER_MOUNTS:+$CONTAINER_MOUNTS,}$LOG_ROOT:$LOG_ROOT
    else
        REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
        [[ -d $REPO_DIR ]] || rlhf_die "REPO_DIR=$REPO_DIR is not a folder"
        cd "$REPO_DIR" || exit 2
        local venv=${VENV:-.venv}
        if [[ -z ${PYTHON:-} && -x $venv/bin/python ]]; then
            PYTHON=$(realpath -s "$venv/bin/python")
        fi
        PYTHON=${PYTHON:-$(command -v python3 || echo python3)}
        export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        mkdir -p "$RLHF_ATTEMPT_DIR" || rlhf_die "cannot create $RLHF_ATTEMPT_DIR"
    fi
    mapfile -t RLHF_NODES < <(rlhf_hostnames "$SLURM_JOB_NODELIST")
    # Each srun task is a rank through SLURM_* variables; stale torchrun variables would shadow them.
    unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
    trap 'rlhf_on_stop SIGUSR1' USR1
    trap 'rlhf_on_stop SIGTERM' TERM
    rlhf_log "job $SLURM_JOB_ID attempt $RLHF_RESTART (at most $((MAX_RESTARTS + 1)) attempts)," \
        "${#RLHF_NODES[@]} node(s): ${RLHF_NODES[*]}; logs: $RLHF_ATTEMPT_DIR"
}

# The srun command line of one step: srun options, then the container wrapper, then COMMAND.
_rlhf_srun_line() {
    local opts=() cmd=()
    while (($#)) && [[ $1 != -- ]]; do opts+=("$1"); shift; done
    shift
    cmd=("$@")
    if [[ -n ${CONTAINER_IMAGE:-} && ${CONTAINER_RUNTIME:-pyxis} == pyxis ]]; then
        opts+=("--container-image=$CONTAINER_IMAGE" "--container-mounts=$CONTAINER_MOUNTS"
               "--container-workdir=$REPO_DIR")
    elif [[ -n ${CONTAINER_IMAGE:-} ]]; then
        local binds=() m
        IFS=, read -ra binds <<<"$CONTAINER_MOUNTS"
        local wrap=(apptainer exec --nv --pwd "$REPO_DIR")
        for m in "${binds[@]}"; do wrap+=(--bind "$m"); done
        cmd=("${wrap[@]}" "$CONTAINER_IMAGE" "${cmd[@]}")
    fi
    RLHF_LINE=(srun "${opts[@]}" "${cmd[@]}")
}

rlhf_srun() {
    local label=$1
    shift
    _rlhf_srun_line "$@"
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        _rlhf_print_line
        RLHF_LAST_PID=""
        return 0
    fi
    if [[ ${RLHF_TEE:-0} == 1 ]]; then  # the driver: also in the job's own output
        "${RLHF_LINE[@]}" > >(tee "$RLHF_ATTEMPT_DIR/$label.log") 2>&1 &
    else
        "${RLHF_LINE[@]}" >"$RLHF_ATTEMPT_DIR/$label.log" 2>&1 &
    fi
    RLHF_LAST_PID=$!
    RLHF_STEPS[$RLHF_LAST_PID]=$label
}

rlhf_run() {
    _rlhf_srun_line "$@"
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        _rlhf_print_line
        return 0
    fi
    "${RLHF_LINE[@]}"
}

_rlhf_print_line() {
    local line
    printf -v line '%q ' "${RLHF_LINE[@]}"
    printf '+ %s\n' "${line% }"
}

# `megatron-rlhf JOB ARGS --check-only` once, before any long step: a bad config, a layout that
# does not fit the job, a missing model is one line here. Its stdout is kept in RLHF_CHECKED.
# Without a container it runs in this shell, under DRY_RUN too (it starts nothing).
rlhf_check_config() {
    local out
    RLHF_CHECKED=""
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        # Only the image has the package: one short step on the first node.
        [[ ${DRY_RUN:-0} == 1 ]] && { rlhf_run --nodes=1 --ntasks=1 -w "${RLHF_NODES[0]}" -- \
            "$PYTHON" -m megatron_rlhf.cli "$@" --check-only; return 0; }
        out=$(rlhf_run --nodes=1 --ntasks=1 -w "${RLHF_NODES[0]}" --quiet -- \
            "$PYTHON" -m megatron_rlhf.cli "$@" --check-only) || exit 2
    else
        out=$("$PYTHON" -m megatron_rlhf.cli "$@" --check-only) || exit 2
    fi
    # shellcheck disable=SC2034  # read by the scripts
    RLHF_CHECKED=$out
}

rlhf_on_stop() {
    RLHF_STOP_SIGNAL=$1
    rlhf_log "$1: asking the run to save and stop at its next step boundary"
    [[ -n ${RLHF_DRIVER_PID:-} ]] && kill -USR1 "$RLHF_DRIVER_PID" 2>/dev/null
    return 0
}

# Ends the background steps other than the driver: TERM (srun passes it to the tasks; `ray start
# --block` stops its own processes on it), then KILL after RLHF_STOP_WAIT_S.
rlhf_stop_steps() {
    local pid deadline=$((SECONDS + ${RLHF_STOP_WAIT_S:-30}))
    for pid in "${!RLHF_STEPS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for pid in "${!RLHF_STEPS[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        unset "RLHF_STEPS[$pid]"
    done
}

# Waits for step PID and returns its exit code. Any other step ending first (a Ray node, the
# head) ends the job within RLHF_STOP_WAIT_S: one line names it, every step is stopped, 1.
rlhf_await() {
    local target=$1 pid rc label
    while :; do
        pid=""
        wait -n -p pid "${!RLHF_STEPS[@]}"
        rc=$?
        [[ -z ${pid:-} ]] && continue  # a trapped signal interrupted the wait
        label=${RLHF_STEPS[$pid]}
        unset "RLHF_STEPS[$pid]"
        if [[ $pid == "$target" ]]; then
            return "$rc"
        fi
        rlhf_log "step $label ended (exit code $rc) before ${RLHF_STEPS[$target]:-its run}:" \
            "ending the job (log: $RLHF_ATTEMPT_DIR/$label.log)" >&2
        rlhf_stop_steps
        return 1
    done
}

# Runs the driver step to its end under supervision; stop signals reach it as USR1.
rlhf_drive() {
    local label=$1 rc
    shift
    if [[ -n $RLHF_STOP_SIGNAL ]]; then
        rlhf_log "$RLHF_STOP_SIGNAL arrived before the run started: nothing to save"
        rlhf_stop_steps
        return "$EXIT_STOPPED"
    fi
    RLHF_TEE=1 rlhf_srun "$label" "$@"
    [[ ${DRY_RUN:-0} == 1 ]] && return 0
    RLHF_DRIVER_PID=$RLHF_LAST_PID
    rlhf_await "$RLHF_DRIVER_PID"
    rc=$?
    RLHF_DRIVER_PID=""
    rlhf_stop_steps
    return "$rc"
}

# A fresh Ray token per attempt, readable by the job's user only, never printed; every step gets
# its path (and RAY_AUTH_MODE=token) through the environment; removed when the script exits.
rlhf_ray_token() {
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN_PATH=$RLHF_ATTEMPT_DIR/ray/auth_token
    [[ ${DRY_RUN:-0} == 1 ]] && return 0
    (
        umask 077
        mkdir -p "$RLHF_ATTEMPT_DIR/ray"
        head -c 32 /dev/urandom | od -An -vtx1 | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH"
    ) || rlhf_die "cannot write $RAY_AUTH_TOKEN_PATH"
    trap 'rm -f "$RAY_AUTH_TOKEN_PATH"' EXIT
}

# A Ray cluster over the job's nodes: the head on the first, one worker on every other, each a
# `ray start --block` step; returns once every node and GPUS_PER_NODE GPUs each have joined, or
# ends the job after RAY_WAIT_S naming the nodes that did not. Sets RAY_HEAD_ADDRESS.
rlhf_ray_cluster() {
    local gpus=$1 cpus=$2 port=$3 wait_s=$4 head=${RLHF_NODES[0]} k node expect=() lines=()
    local -A addr=()
    local ray=${RAY:-$(dirname "$PYTHON")/ray}
    [[ -n ${CONTAINER_IMAGE:-} || $PYTHON != */* ]] && ray=${RAY:-ray}
    rlhf_ray_token
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        for node in "${RLHF_NODES[@]}"; do addr[$node]=$node; done
    else
        # shellcheck disable=SC2016  # expanded on each node
        mapfile -t lines < <(srun --nodes="${#RLHF_NODES[@]}" --ntasks="${#RLHF_NODES[@]}" \
            --ntasks-per-node=1 bash -c 'echo "$SLURMD_NODENAME $(hostname --ip-address | cut -d" " -f1)"')
        for k in "${lines[@]}"; do addr[${k%% *}]=${k##* }; done
        for node in "${RLHF_NODES[@]}"; do
            [[ -n ${addr[$node]:-} ]] || rlhf_die "no address for node $node (srun hostname failed)"
        done
    fi
    RAY_HEAD_ADDRESS=${addr[$head]}:$port
    local common=(--num-gpus="$gpus" --num-cpus="$cpus" --disable-usage-stats --block)
    rlhf_srun "ray-head-$head" --nodes=1 --ntasks=1 -w "$head" -- "$ray" start --head \
        --node-ip-address="${addr[$head]}" --port="$port" --include-dashboard=false \
        --temp-dir="/tmp/ray_${SLURM_JOB_ID}_0" "${common[@]}"
    for k in "${!RLHF_NODES[@]}"; do
        node=${RLHF_NODES[$k]}
        expect+=("$node=${addr[$node]}")
        ((k == 0)) && continue
        rlhf_srun "ray-$node" --nodes=1 --ntasks=1 -w "$node" -- "$ray" start \
            --address="$RAY_HEAD_ADDRESS" --node-ip-address="${addr[$node]}" \
            --temp-dir="/tmp/ray_${SLURM_JOB_ID}_$k" "${common[@]}"
    done
    local nodes_csv
    nodes_csv=$(IFS=,; echo "${expect[*]}")
    rlhf_srun ray-wait --overlap --nodes=1 --ntasks=1 -w "$head" -- "$PYTHON" -m \
        megatron_rlhf.orchestration.ray_wait --address "$RAY_HEAD_ADDRESS" \
        --nodes "${#RLHF_NODES[@]}" --gpus-per-node "$gpus" --timeout "$wait_s" \
        --expect "$nodes_csv"
    [[ ${DRY_RUN:-0} == 1 ]] && return 0
    local waiter=$RLHF_LAST_PID
    if ! rlhf_await "$waiter"; then
        local why
        why=$(grep -h '^\[ray_wait\]' "$RLHF_ATTEMPT_DIR/ray-wait.log" 2>/dev/null | tail -n 1)
        rlhf_stop_steps
        rlhf_die "the Ray cluster did not come up${why:+: ${why#\[ray_wait\] }} (logs: $RLHF_ATTEMPT_DIR)"
    fi
    rlhf_log "$(tail -n 1 "$RLHF_ATTEMPT_DIR/ray-wait.log")"
}

# Ray's per-node folders of this job (sessions, logs, sockets): removed once Ray has stopped.
rlhf_ray_cleanup() {
    srun --nodes="${#RLHF_NODES[@]}" --ntasks="${#RLHF_NODES[@]}" --ntasks-per-node=1 \
        bash -c "rm -rf /tmp/ray_${SLURM_JOB_ID}_*" >/dev/null 2>&1 || true
}

# train-rm and sft: one task per GPU, each task a rank (the CLI reads SLURM_PROCID, SLURM_NTASKS,
# SLURM_LOCALID and rendezvous at MASTER_ADDR:MASTER_PORT); the config checked for that many ranks
# first. Returns the ranks' exit code.
rlhf_ranks_job() {
    local job=$1 extra=()
    : "${CONFIG:?set CONFIG to a $job config YAML}"
    read -r -a extra <<<"${OVERRIDES:-}"
    local ranks=${SLURM_NTASKS:-$((SLURM_JOB_NUM_NODES * ${SLURM_NTASKS_PER_NODE:-8}))}
    rlhf_check_config "$job" --config "$CONFIG" "${extra[@]}" --world-size "$ranks"
    export MASTER_ADDR=${MASTER_ADDR:-${RLHF_NODES[0]}}
    export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    rlhf_log "$ranks rank(s), rendezvous $MASTER_ADDR:$MASTER_PORT"
    # Slurm 22.05's srun does not inherit --cpus-per-task from sbatch: passed on explicitly.
    # Not --kill-on-bad-exit: the ranks of a clean stop all exit 75 (non-zero), a few seconds
    # apart; instead, once one rank has ended the others get RANK_EXIT_WAIT_S to follow (a rank
    # that crashed leaves the rest waiting in a collective: they are ended then).
    rlhf_drive "$job" --kill-on-bad-exit=0 --wait="${RANK_EXIT_WAIT_S:-60}" \
        --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" -- \
        "$PYTHON" -m megatron_rlhf.cli "$job" --config "$CONFIG" "${extra[@]}"
}

rlhf_finish() {
    local rc=$1
    if ((rc == 0)); then
        rlhf_log "finished"
        exit 0
    fi
    if ((rc != EXIT_STOPPED)); then
        rlhf_log "failed (exit code $rc): not requeued" >&2
        exit "$rc"
    fi
    if ((RLHF_RESTART >= MAX_RESTARTS)); then
        rlhf_log "stopped to be resumed, but this was restart $RLHF_RESTART of MAX_RESTARTS=$MAX_RESTARTS:" \
            "not requeued; submit the same job again to continue" >&2
        exit "$EXIT_STOPPED"
    fi
    rlhf_log "stopped to be resumed: requeueing (restart $((RLHF_RESTART + 1)) of $MAX_RESTARTS)"
    scontrol requeue "$SLURM_JOB_ID" || rlhf_die "scontrol requeue $SLURM_JOB_ID failed"
    exit 0
}
