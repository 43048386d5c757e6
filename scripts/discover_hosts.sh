#!/usr/bin/env bash
# Host discovery for elastic training: horovodrun runs this every few seconds
# and (re)sizes the job to the hosts it prints, one `host:slots` per line.
#
#   horovodrun -np 8 --min-np 4 --max-np 35 \
#       --host-discovery-script scripts/discover_hosts.sh covidxray train --elastic ...
#
# It reads a hosts file (COVIDXRAY_HOSTS_FILE, default ./hosts.txt), one board
# per line as `host`, `host:slots` or `host slots=N` (the hostfile format of
# horovodrun/mpirun and scripts/cluster, so one file serves static and elastic
# jobs); blank lines and `#` comments are skipped and a bare host gets
# COVIDXRAY_DEFAULT_SLOTS (default 1) slots. To take a board out of the job,
# comment out its line; to add one, add a line.
set -euo pipefail

hosts_file="${COVIDXRAY_HOSTS_FILE:-hosts.txt}"
default_slots="${COVIDXRAY_DEFAULT_SLOTS:-1}"

if [[ ! -r "$hosts_file" ]]; then
    echo "discover_hosts.sh: cannot read hosts file '$hosts_file' (set COVIDXRAY_HOSTS_FILE)" >&2
    exit 1
fi

while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line%%#*}"
    read -r host rest <<< "$line" || true
    [[ -z "${host:-}" ]] && continue
    if [[ "$host" == *:* && -z "${rest:-}" ]]; then
        entry="$host"
    elif [[ -z "${rest:-}" ]]; then
        entry="$host:$default_slots"
    elif [[ "$rest" =~ ^slots=([0-9]+)$ ]]; then
        entry="$host:${BASH_REMATCH[1]}"
    else
        entry="$host $rest"
    fi
    if [[ ! "$entry" =~ ^[^:[:space:]]+:[0-9]+$ ]]; then
        # skipped, not fatal: a typo made while the job runs must not end it
        echo "discover_hosts.sh: $hosts_file: skipping '$entry' (expected host, host:slots or host slots=N)" >&2
        continue
    fi
    echo "$entry"
done < "$hosts_file"
