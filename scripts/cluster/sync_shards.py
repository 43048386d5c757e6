#!/usr/bin/env python3
"""Give every board the shards its ranks will read, and nothing else.

A Pi's SD card is small and copying a full data set 35 times is slow, so each
host gets manifest.json and only the train and val shards its ranks read
(see shard_plan.py: the trainer's own `assign_shards` and Horovod's own rank
placement), so the copy matches the run exactly. Elastic runs re-number ranks
when boards come and go, so `--all` copies every shard.
`--nfs PATH` copies nothing: it checks that every board sees the data at PATH.

    sync_shards.py --hostfile hostfile --data-dir /data/covid            # rsync to the same path on every board
    sync_shards.py --hostfile hostfile --data-dir /data/covid --nfs /mnt/covid
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nodes import (  # noqa: E402
    ClusterError,
    Ssh,
    add_cluster_arguments,
    local_hosts,
    main_guard,
    on_every_host,
    read_hostfile,
    ssh_from_args,
)
from shard_plan import SHARDS, HostPlan, add_plan_arguments, plan  # noqa: E402

from covidxray.files import sha256_file  # noqa: E402
from covidxray.manifest import MANIFEST  # noqa: E402


def missing_on_host(
    ssh: Ssh, host: str, root: str, expected: dict[str, int], manifest_sha: str, is_local: bool
) -> list[str]:
    """What `host` lacks under `root`: files absent or of the wrong size, or a manifest from another prepare."""
    listing = f"cd {shlex.quote(root)} && sha256sum {MANIFEST} && find {SHARDS} -maxdepth 1 -type f -printf '%s %p\\n'"
    result = ssh.run(host, listing, local=is_local)
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines:
        return [f"{root}/{MANIFEST} ({(result.stderr.strip() or 'not found')[-200:]})"]
    problems = (
        []
        if lines[0].split()[0] == manifest_sha
        else [f"{root}/{MANIFEST} differs from the launcher's: re-sync or re-mount"]
    )
    sizes = {path: int(size) for size, path in (line.split(" ", 1) for line in lines[1:])}
    problems += [f"{root}/{name}" for name, size in expected.items() if name != MANIFEST and sizes.get(name) != size]
    return problems


def rsync(
    ssh: Ssh, host: str, data_dir: Path, dest: str, files: list[str], is_local: bool
) -> subprocess.CompletedProcess:
    command = ["rsync", "--archive", "--partial", "--itemize-changes", "--files-from=-"]
    if is_local:
        Path(dest).mkdir(parents=True, exist_ok=True)
        command += [f"{data_dir}/", dest]
    else:  # the remote rsync creates the destination first, so a fresh board needs no setup
        command += [
            "--rsync-path",
            f"mkdir -p {shlex.quote(dest)} && rsync",
            "-e",
            ssh.rsync_shell(),
            f"{data_dir}/",
            f"{host}:{dest}",
        ]
    return subprocess.run(command, input="\n".join(files) + "\n", capture_output=True, text=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(parser)
    parser.add_argument(
        "--data-dir", type=Path, required=True, help="Prepared data on this machine (covidxray prepare output)."
    )
    parser.add_argument(
        "--remote-data-dir",
        default=None,
        help="Path on the boards (default: the same as --data-dir; training passes one --data-dir to every rank).",
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="HOST",
        help="Sync just these hosts (e.g. a re-flashed board); repeatable.",
    )
    parser.add_argument(
        "--nfs",
        default=None,
        metavar="PATH",
        help="Shared mount: copy nothing, check every board sees the data at PATH.",
    )
    parser.add_argument("--dry-run", action="store_true", help="Print the plan as JSON and stop.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = args.data_dir.resolve()
    plans = plan(data_dir, read_hostfile(args.hostfile), args.num_proc, args.every_shard)
    if args.only:
        unknown = set(args.only) - {p.host for p in plans}
        if unknown:
            raise ClusterError(f"--only {', '.join(sorted(unknown))}: not a host that gets ranks in {args.hostfile}")
        plans = [p for p in plans if p.host in args.only]
    if args.dry_run:
        print(json.dumps([p.__dict__ for p in plans], indent=2))
        return 0

    ssh = ssh_from_args(args)
    root = args.nfs or args.remote_data_dir or str(data_dir)
    local = local_hosts(p.host for p in plans)
    manifest_sha = sha256_file(Path(data_dir) / MANIFEST)  # the file's bytes: the copy on each board must be this one

    def sync_one(host_plan: HostPlan) -> tuple[HostPlan, str, list[str]]:
        is_local = host_plan.host in local
        note = "checked"
        if not args.nfs:
            if is_local and Path(root).resolve() == data_dir:
                note = "local: reads --data-dir in place"
            else:
                result = rsync(ssh, host_plan.host, data_dir, root, host_plan.files, is_local)
                if result.returncode != 0:
                    return host_plan, "rsync failed", [result.stderr.strip()[-500:]]
                note = f"{sum(1 for line in result.stdout.splitlines() if line[:2] in ('<f', '>f'))} file(s) copied"
        expected = {f: (data_dir / f).stat().st_size for f in host_plan.files}
        return host_plan, note, missing_on_host(ssh, host_plan.host, root, expected, manifest_sha, is_local)

    failures = 0
    for host_plan, note, problems in on_every_host(sync_one, plans):
        status = "ok" if not problems else "MISSING"
        print(
            f"{host_plan.host:20s} ranks {','.join(map(str, host_plan.ranks)):8s} {len(host_plan.files) - 1:4d} shards  {note:32s} {status}"
        )
        for problem in problems:
            print(f"    {problem}")
        failures += bool(problems)
    if failures:
        print(f"{failures} host(s) are missing data under {root}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    main_guard(main)
