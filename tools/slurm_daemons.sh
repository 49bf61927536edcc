# shellcheck shell=bash
# Helpers for starting and stopping daemons, shared by tools/slurm_local.sh and
# tools/slurm_two_nodes.sh (sourced, never run on its own).

# True when the process named in pid file $1 is alive.
pid_alive() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

# Kill the process in pid file $1 (TERM, then KILL after 10 s) and remove the file.
stop_pid() {
    local file=$1 pid _
    if pid_alive "$file"; then
        pid=$(<"$file")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

# Install whichever of the Debian packages named are missing (apt-get, as root); on failure
# print why and return 1.
install_packages() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    if ! command -v apt-get >/dev/null; then
        echo "missing packages ${missing[*]} and no apt-get" >&2
        return 1
    fi
    if ((EUID != 0)); then
        echo "missing packages ${missing[*]}; run as root to install them" >&2
        return 1
    fi
    echo "installing ${missing[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
}
