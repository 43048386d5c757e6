#!/usr/bin/env python3
"""Before a long run: is every board ready, and are they all the same?

Runs `covidxray doctor --json` on every host of the hostfile (over ssh, or
directly on the launcher), then fails if any board is unreachable, lacks
something training needs, runs different versions of Python / covidxray /
TensorFlow / Horovod / ... than the others, or is missing (or has a changed
copy of) a shard its ranks will read. Free memory and disk are shown so a
board that will swap or fill up stands out; doctor's own thresholds warn.

    check_nodes.py --hostfile hostfile --data-dir /data/covid
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nodes import Ssh, add_cluster_arguments, local_hosts, main_guard, on_every_host, read_hostfile, ssh_from_args  # noqa: E402
from shard_plan import add_plan_arguments, plan  # noqa: E402

DEFAULT_COVIDXRAY = str(Path(sys.executable).parent / "covidxray")  # boards keep the venv at the launcher's path


@dataclass
class NodeResult:
    host: str
    report: dict | None = None
    problems: list[str] = field(default_factory=list)


def doctor_on(ssh: Ssh, host: str, covidxray: str, data_dir: str | None, is_local: bool) -> NodeResult:
    command = f"TF_CPP_MIN_LOG_LEVEL=3 {shlex.quote(covidxray)} doctor --json"
    if data_dir:
        command += f" --data-dir {shlex.quote(data_dir)}"
    result = ssh.run(host, command, local=is_local)
    try:
        report = json.loads(result.stdout)  # doctor exits 1 when a check fails, still printing its report
    except json.JSONDecodeError:
        reason = (result.stderr.strip() or result.stdout.strip() or f"exit {result.returncode}").splitlines()[-1]
        return NodeResult(host, problems=[f"no doctor report: {reason}"])
    return NodeResult(host, report)


def failed_checks(report: dict) -> list[str]:
    """Required checks that failed, except the shard check: a board need not hold other boards' shards."""
    return [
        f"{c['name']}: {c['detail']}"
        for c in report["checks"]
        if c["required"] and not c["ok"] and not c["name"].startswith("shards")
    ]


def shard_problems(report: dict, needed: list[str]) -> list[str]:
    shards = report.get("shards") or {}
    names = {Path(f).name for f in needed}
    missing = sorted(names & set(shards.get("missing", [])))
    changed = sorted(names & set(shards.get("sha256_mismatch", [])))
    return [f"missing shard {name}" for name in missing] + [
        f"shard {name} differs from the manifest" for name in changed
    ]


def version_mismatches(results: list[NodeResult]) -> list[str]:
    """One line per package whose version is not the same on every reachable board."""
    by_package: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for result in results:
        if result.report:
            for package, version in result.report["versions"].items():
                by_package[package][str(version)].append(result.host)
    lines = []
    for package, hosts_by_version in sorted(by_package.items()):
        if len(hosts_by_version) > 1:
            spread = "; ".join(
                f"{version} on {', '.join(hosts)}"
                for version, hosts in sorted(hosts_by_version.items(), key=lambda kv: -len(kv[1]))
            )
            lines.append(f"{package} differs: {spread}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(parser)
    parser.add_argument(
        "--data-dir",
        default=None,
        help="Prepared data, at the same path on the launcher and the boards; checks each board's shards.",
    )
    add_plan_arguments(parser)
    parser.add_argument(
        "--covidxray", default=DEFAULT_COVIDXRAY, help="covidxray executable on the boards (default: %(default)s)."
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hosts = read_hostfile(args.hostfile)
    names = [h.hostname for h in hosts]
    needed = (
        {p.host: p.files for p in plan(Path(args.data_dir), hosts, args.num_proc, args.every_shard)}
        if args.data_dir
        else {}
    )
    ssh, local = ssh_from_args(args), local_hosts(names)
    results = on_every_host(lambda host: doctor_on(ssh, host, args.covidxray, args.data_dir, host in local), names)

    for result in results:
        if result.report:
            result.problems += failed_checks(result.report) + shard_problems(result.report, needed.get(result.host, []))
    mismatches = version_mismatches(results)

    print(f"{'host':20s} {'covidxray':10s} {'tensorflow':11s} {'horovod':8s} {'mem MB':>7s} {'disk MB':>8s}  status")
    for result in results:
        versions = (result.report or {}).get("versions", {})
        system = (result.report or {}).get("system", {})
        print(
            f"{result.host:20s} {versions.get('covidxray') or '-':10s} {versions.get('tensorflow') or '-':11s} {versions.get('horovod') or '-':8s} "
            f"{system.get('memory_available_mb') or '-':>7} {system.get('disk_free_mb') or '-':>8}  {'ok' if not result.problems else 'FAIL'}"
        )
        for problem in result.problems:
            print(f"    {problem}")
    for line in mismatches:
        print(f"MISMATCH {line}")
    bad = sum(1 for r in results if r.problems)
    if bad or mismatches:
        print(f"not ready: {bad} board(s) failing, {len(mismatches)} version mismatch(es)", file=sys.stderr)
        return 1
    print(f"all {len(results)} board(s) ready")
    return 0


if __name__ == "__main__":
    main_guard(main)
