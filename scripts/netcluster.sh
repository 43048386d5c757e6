#!/usr/bin/env bash
# An emulated Raspberry Pi cluster on this machine: one network namespace per board, each joined to a bridge
# (the switch) by a veth pair whose two ends are shaped with tc like a Pi 4's gigabit port, and an sshd in
# every board namespace so horovodrun reaches the ranks over ssh, as on real boards. A separate "launcher"
# namespace plays the machine horovodrun runs on. Nothing leaves this machine: the bridge has no uplink and the
# root namespace gets no address on it. Needs root (ip netns, tc).
#
#   scripts/netcluster.sh up [-n BOARDS] [--line-mbit 1000|100|...] [--delay-us 50] [--name cxr]
#   scripts/netcluster.sh exec [--name cxr] -- horovodrun -np 4 --hostfile "$STATE/hostfile" ...   # in the launcher
#   scripts/netcluster.sh run  [up options] -- COMMAND ...   # up, COMMAND in the launcher namespace, down (always)
#   scripts/netcluster.sh status [--name cxr]
#   scripts/netcluster.sh down [--name cxr]
#
# `up` first removes whatever an earlier cluster of the same name left behind (idempotent), and removes what it
# built so far when it fails or is interrupted; `run` tears the cluster down on exit, Ctrl-C or SIGTERM.
#
# Shaping, per board port and per direction (the board's egress on its eth0, its ingress on the bridge side):
# tbf limits the rate to the line rate less Ethernet's preamble, FCS and inter-frame gap (24 of every 1538
# bytes on the wire, which tc does not see), so a TCP stream carries 1448/1538 of the line rate as payload:
# 941 Mbit/s at 1000 Mbit/s, 94 Mbit/s at 100 Mbit/s (a cheap switch). netem adds --delay-us one way (a Pi 4
# through a gigabit switch pings in ~0.2 ms: 50 us per port and direction plus the stack) when the kernel has
# sch_netem; without it the links keep the stack's own latency (a few us), and `up` says so.
#
# After `up`, $STATE (/run/covidxray-netcluster-NAME) holds: hostfile (board addresses, slots=1), id_ed25519
# (the client key every board accepts), bin/ssh (an ssh wrapper using the cluster's own known_hosts; put bin/
# first on PATH, `exec` does), env (shell assignments: STATE, LAUNCHER_NS, BOARDS, ...), sshd-*.log.
set -Eeuo pipefail  # -E: the ERR trap of `up` also fires inside functions

NAME=cxr
BOARDS=8
LINE_MBIT=1000
DELAY_US=50
SUBNET=10.213.0   # /24; launcher .1, board i at .(10+i)

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
die() { echo "netcluster: $*" >&2; exit 2; }

action=${1:-}; [ $# -gt 0 ] && shift
[ -n "$action" ] || usage
command_args=()
while [ $# -gt 0 ]; do
  case $1 in
    -n|--boards) BOARDS=$2; shift 2 ;;
    --line-mbit) LINE_MBIT=$2; shift 2 ;;
    --delay-us) DELAY_US=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --subnet) SUBNET=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; command_args=("$@"); break ;;
    *) die "unknown option $1 (see $0 --help)" ;;
  esac
done
[[ $BOARDS =~ ^[0-9]+$ ]] && [ "$BOARDS" -ge 1 ] && [ "$BOARDS" -le 200 ] || die "-n wants 1..200 boards, got $BOARDS"
[[ $LINE_MBIT =~ ^[0-9]+$ ]] && [ "$LINE_MBIT" -ge 1 ] || die "--line-mbit wants a positive integer, got $LINE_MBIT"
[[ $DELAY_US =~ ^[0-9]+$ ]] || die "--delay-us wants an integer >= 0, got $DELAY_US"
[[ $NAME =~ ^[a-z][a-z0-9]{0,5}$ ]] || die "--name wants 1-6 lowercase letters/digits (it prefixes interface names), got $NAME"
[[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--subnet wants the first three octets of a /24, e.g. 10.213.0"

STATE=/run/covidxray-netcluster-$NAME
LAUNCHER_NS=$NAME-launch
BRIDGE=${NAME}br
SSHD=$(command -v sshd || echo /usr/sbin/sshd)

board_ns() { echo "$NAME-b$1"; }

require_root() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces and tc): run it with sudo"
  for tool in ip tc ssh-keygen "$SSHD"; do command -v "$tool" >/dev/null || die "$tool not found (apt install iproute2 openssh-server openssh-client)"; done
}

# Namespaces of this cluster, whatever their number when it was built.
our_namespaces() { ip netns list | awk '{print $1}' | grep -E "^$NAME-(launch|b[0-9]+)$" || true; }

down() {
  local ns pid
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done  # our sshds and their sessions
  done
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns delete "$ns" 2>/dev/null || true  # deletes the namespace end of each veth, hence the pair
  done
  rm -rf /etc/netns/"$NAME"-launch /etc/netns/"$NAME"-b[0-9]*
  # The kernel frees a deleted namespace (and the veth ends inside it) later, in a work queue, so the host ends
  # may outlive `down` by a moment: delete them here (either end takes its pair along).
  local link
  for link in $(ip -o link show | sed -n "s/^[0-9]*: \($NAME\(br\|np0\|vl\|v[0-9]*\)\)[@:].*/\1/p"); do
    ip link delete "$link" 2>/dev/null || true
  done
  rm -rf "$STATE"
}

# Shape one end of a veth: tbf (rate), under netem (one-way delay) when the kernel has sch_netem.
# `in_ns` is empty for the root namespace.
shape() {
  local in_ns=$1 dev=$2
  local tc_rate_kbit=$((LINE_MBIT * 1000 * 1514 / 1538))
  local burst=$((tc_rate_kbit * 1000 / 8 / 1000))  # one millisecond at the rate...
  [ "$burst" -lt 131072 ] && burst=131072           # ...but at least two 64 KiB GSO packets
  local run=() parent=root
  [ -n "$in_ns" ] && run=(ip netns exec "$in_ns")
  if [ "$DELAY_US" -gt 0 ] && [ "$HAVE_NETEM" = 1 ]; then
    "${run[@]}" tc qdisc add dev "$dev" root handle 1: netem delay "${DELAY_US}us" limit 100000
    parent="parent 1:1"
  fi
  "${run[@]}" tc qdisc add dev "$dev" $parent handle 10: tbf rate "${tc_rate_kbit}kbit" burst "$burst" latency 20ms
}

# Some kernels (e.g. minimal VM kernels) are built without sch_netem: then the delay is what the stack gives.
probe_netem() {
  HAVE_NETEM=0
  [ "$DELAY_US" -gt 0 ] || return 0
  ip link add "${NAME}np0" type veth peer name "${NAME}np1"
  tc qdisc add dev "${NAME}np0" root netem delay 1us 2>/dev/null && HAVE_NETEM=1
  ip link delete "${NAME}np0"
  [ "$HAVE_NETEM" = 1 ] || echo "netcluster: this kernel has no sch_netem: no added delay (--delay-us $DELAY_US ignored), links keep the stack's own sub-ms latency" >&2
}

add_host() {  # namespace, address, host-side veth name
  local ns=$1 address=$2 veth=$3
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BRIDGE" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$address/24" dev eth0
  ip -n "$ns" link set eth0 up
  # Horovod 0.28.1 opens the Gloo connections that carry the allreduce (its process-set contexts) on the
  # address the machine's hostname resolves to, ignoring HOROVOD_GLOO_IFACE (see docs/cluster.md). All
  # namespaces share this machine's hostname, so each one resolves it to its own address: `ip netns exec`
  # mounts /etc/netns/NS/hosts over /etc/hosts for everything started in NS (sshd, hence the ranks).
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n%s %s\n' "$address" "$(hostname)" >"/etc/netns/$ns/hosts"
  shape "$ns" eth0
  shape "" "$veth"
}

start_sshd() {  # namespace, address
  local ns=$1 address=$2
  cat >"$STATE/sshd-$ns.conf" <<EOF
ListenAddress $address:22
HostKey $STATE/host_key
PidFile $STATE/sshd-$ns.pid
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM $([ -f /etc/pam.d/sshd ] && echo yes || echo no)
StrictModes no
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
EOF
  ip netns exec "$ns" "$SSHD" -f "$STATE/sshd-$ns.conf" -E "$STATE/sshd-$ns.log"  # daemonizes once listening
}

up() {
  require_root
  down
  trap 'echo "netcluster: set-up failed or interrupted, removing what was built" >&2; down; exit 1' ERR INT TERM
  mkdir -p "$STATE/bin" /run/sshd
  chmod 700 "$STATE"
  ssh-keygen -q -t ed25519 -N "" -C "covidxray-netcluster host" -f "$STATE/host_key"
  ssh-keygen -q -t ed25519 -N "" -C "covidxray-netcluster client" -f "$STATE/id_ed25519"
  cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
  cat >"$STATE/ssh_config" <<EOF
Host *
  UserKnownHostsFile $STATE/known_hosts
  StrictHostKeyChecking accept-new
  IdentityFile $STATE/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
  LogLevel ERROR
EOF
  printf '#!/bin/sh\nexec %s -F %s "$@"\n' "$(command -v ssh)" "$STATE/ssh_config" >"$STATE/bin/ssh"
  chmod 755 "$STATE/bin/ssh"

  probe_netem
  ip link add "$BRIDGE" type bridge
  ip link set "$BRIDGE" up
  add_host "$LAUNCHER_NS" "$SUBNET.1" "${NAME}vl"
  : >"$STATE/hostfile"
  local i
  for i in $(seq 1 "$BOARDS"); do
    add_host "$(board_ns "$i")" "$SUBNET.$((10 + i))" "${NAME}v$i"
    start_sshd "$(board_ns "$i")" "$SUBNET.$((10 + i))"
    echo "$SUBNET.$((10 + i)) slots=1" >>"$STATE/hostfile"
  done
  for i in $(seq 1 "$BOARDS"); do  # every board answers ssh (also fills known_hosts)
    ip netns exec "$LAUNCHER_NS" "$STATE/bin/ssh" "$SUBNET.$((10 + i))" true \
      || { echo "netcluster: board $i ($SUBNET.$((10 + i))) does not answer ssh; see $STATE/sshd-$(board_ns "$i").log" >&2; false; }
  done
  cat >"$STATE/env" <<EOF
STATE=$STATE
LAUNCHER_NS=$LAUNCHER_NS
BOARDS=$BOARDS
LINE_MBIT=$LINE_MBIT
DELAY_US=$([ "$HAVE_NETEM" = 1 ] && echo "$DELAY_US" || echo 0)
SUBNET=$SUBNET
PAYLOAD_MBIT=$(awk -v l="$LINE_MBIT" 'BEGIN { printf "%.1f", l * 1448 / 1538 }')
EOF
  trap - ERR INT TERM
  echo "netcluster $NAME: $BOARDS board(s) $SUBNET.11-$((10 + BOARDS)), ${LINE_MBIT} Mbit/s line rate, $(grep DELAY_US "$STATE/env" | cut -d= -f2) us added one-way per port; state in $STATE"
}

in_launcher() {
  [ -f "$STATE/env" ] || die "no cluster named $NAME is up (scripts/netcluster.sh up --name $NAME)"
  [ ${#command_args[@]} -gt 0 ] || die "nothing to run: give the command after --"
  PATH="$STATE/bin:$PATH" NETCLUSTER_STATE="$STATE" ip netns exec "$LAUNCHER_NS" "${command_args[@]}"
}

case $action in
  up) up ;;
  down) require_root; down; echo "netcluster $NAME: down" ;;
  exec) require_root; in_launcher ;;
  run)
    # The EXIT trap before `up`: a signal at any moment from here on removes whatever was built. `up` traps INT and
    # TERM while it builds and clears them once the cluster is up (its state file already there); a signal then,
    # before the traps below, ends bash by default, which still runs the EXIT trap.
    trap 'down' EXIT
    up
    stop() { kill -TERM $(jobs -p) 2>/dev/null || true; wait; exit "$1"; }
    trap 'stop 130' INT
    trap 'stop 143' TERM
    # In the background, because bash runs a trap only once its foreground command has finished: `wait` returns
    # at once on a signal, the trap stops the command, and the EXIT trap removes the cluster.
    in_launcher &
    wait $!
    ;;
  status)
    namespaces=$(our_namespaces)
    if [ -z "$namespaces" ]; then echo "netcluster $NAME: down"; exit 1; fi
    cat "$STATE/env" 2>/dev/null || echo "netcluster $NAME: partly up (no $STATE/env); run down"
    for ns in $namespaces; do echo "$ns: $(ip netns exec "$ns" tc qdisc show dev eth0 | tr '\n' ' ')"; done
    ;;
  *) usage ;;
esac
