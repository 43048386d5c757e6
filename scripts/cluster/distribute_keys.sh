#!/usr/bin/env bash
# Let the launcher ssh into every board without a password (horovodrun, rsync
# and check_nodes.py all run ssh non-interactively).
#
#   distribute_keys.sh [-i KEY] [-p PORT] [-b BOOTSTRAP_KEY] [-o SSH_OPTION]... HOSTFILE
#
# HOSTFILE: make_hostfile.py's output (or any file with one board per line, `host`,
# `host:slots` or `host slots=N`, # comments). For each board it appends KEY.pub to
# ~/.ssh/authorized_keys there unless already present (safe to re-run), then checks
# that KEY alone logs in. KEY defaults to ~/.ssh/id_ed25519 and is created if missing.
# The one login that installs the key asks for the board's password; with
# SSHPASS=... in the environment and `sshpass` installed it is typed for you (a fresh
# image where all boards share one password), or -b names a key the boards already
# accept. Host keys are recorded on first contact (StrictHostKeyChecking=accept-new).
set -euo pipefail

key="${HOME}/.ssh/id_ed25519"
bootstrap=""
ssh_opts=(-o StrictHostKeyChecking=accept-new -o ConnectTimeout=10)
usage() { sed -n '5p' "$0" | sed 's/^# *//' >&2; exit 2; }
while getopts "i:p:b:o:h" opt; do
    case "$opt" in
        i) key="$OPTARG" ;;
        p) ssh_opts+=(-p "$OPTARG") ;;
        b) bootstrap="$OPTARG" ;;
        o) ssh_opts+=(-o "$OPTARG") ;;
        *) usage ;;
    esac
done
shift $((OPTIND - 1))
[[ $# -eq 1 ]] || usage
hostfile="$1"
[[ -r "$hostfile" ]] || { echo "distribute_keys.sh: cannot read $hostfile (write it with make_hostfile.py)" >&2; exit 2; }

if [[ ! -f "$key" ]]; then
    mkdir -p "$(dirname "$key")" && chmod 700 "$(dirname "$key")"
    ssh-keygen -q -t ed25519 -N "" -C "covidxray-launcher@$(hostname)" -f "$key"
    echo "created $key"
fi
[[ -r "$key.pub" ]] || { echo "distribute_keys.sh: $key.pub is missing (ssh-keygen -y -f $key > $key.pub)" >&2; exit 2; }

install_login=(ssh "${ssh_opts[@]}")
if [[ -n "$bootstrap" ]]; then
    install_login+=(-o BatchMode=yes -o IdentitiesOnly=yes -i "$bootstrap")
elif [[ -n "${SSHPASS:-}" ]] && command -v sshpass >/dev/null; then
    install_login=(sshpass -e "${install_login[@]}")
fi
# Runs on the board; the public key arrives on stdin, so no quoting of its text is needed.
append_key='umask 077; mkdir -p ~/.ssh; k=$(cat); touch ~/.ssh/authorized_keys; grep -qxF "$k" ~/.ssh/authorized_keys || printf "%s\n" "$k" >> ~/.ssh/authorized_keys'

failed=0
hosts=$(sed -e 's/#.*//' "$hostfile" | awk 'NF { sub(/:.*/, "", $1); print $1 }')
for host in $hosts; do
    if ssh "${ssh_opts[@]}" -o BatchMode=yes -o IdentitiesOnly=yes -i "$key" "$host" true 2>/dev/null </dev/null; then
        echo "$host: key already accepted"
        continue
    fi
    if ! "${install_login[@]}" "$host" "$append_key" < "$key.pub"; then
        echo "$host: FAILED to install the key" >&2
        failed=$((failed + 1))
    elif ssh "${ssh_opts[@]}" -o BatchMode=yes -o IdentitiesOnly=yes -i "$key" "$host" true </dev/null; then
        echo "$host: key installed"
    else
        echo "$host: key appended but still not accepted (sshd's AuthorizedKeysFile? permissions of ~/.ssh?)" >&2
        failed=$((failed + 1))
    fi
done
if [[ $failed -gt 0 ]]; then
    echo "$failed board(s) without the key" >&2
    exit 1
fi
