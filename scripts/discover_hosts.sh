#!/usr/bin/env bash
# Host discovery for elastic training: horovodrun runs this every few seconds
# and (re)sizes the job to the hosts it prints, one `host:slots` per line.
#
#   horovodrun -np 8 --min-np 4 --max-np 35 \
#       --host-discovery-script scripts/discover_hosts.sh covidxray train --elastic ...
#
# It reads a hosts file (COVIDXRAY_HOSTS_FILE, default ./hosts.txt), one board
# per line as `host` or `host:slots`; blank lines and `#` comments are skipped
# and a bare host gets COVIDXRAY_DEFAULT_SLOTS (default 1) slots. To take a
# board out of the job, comment out its line; to add one, add a line.
set -euo pipefail

hosts_file="${COVIDXRAY_HOSTS_FILE:-hosts.txt}"
default_slots="${COVIDXRAY_DEFAULT_SLOTS:-1}"

if [[ ! -r "$hosts_file" ]]; then
    echo "discover_hosts.sh: cannot read hosts file '$hosts_file' (set COVIDXRAY_HOSTS_FILE)" >&2
    exit 1
fi

while IFS= read -r line || [[ -n "$line" ]]; do
    line="${line%%#*}"
    line="${line//[[:space:]]/}"
    [[ -z "$line" ]] && continue
    if [[ "$line" != *:* ]]; then
        line="$line:$default_slots"
    fi
    if [[ ! "$line" =~ ^[^:]+:[0-9]+$ ]]; then
        # skipped, not fatal: a typo made while the job runs must not end it
        echo "discover_hosts.sh: $hosts_file: skipping '$line' (expected host or host:slots)" >&2
        continue
    fi
    echo "$line"
done < "$hosts_file"
