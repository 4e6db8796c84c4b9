"""The soak (issue 36): a trainer publishing `--steps` steps (a full snapshot every 25) to a real
SeaweedFS, replicas (loader + reference engine; the last `--vllm` of them a real vLLM CPU engine
from .venv-vllm/ with its loader `--engine vllm`) following it, retention after every publish,
the operator's two replicas on a real API server (a HotLoadDeployment on the soak's ledger, the
loaders reporting to its pods and following its head handoff), and overlapping faults from a
seeded schedule (the API server restarted, the operator's leader killed, frozen and cut off
from the API server, a second deployment's bucket answering in 20 s among them; the first
engine and loader kill on a vLLM replica); every check with its figures, every miss failing
(exit status 1).

    .venv/bin/python benchmarks/soak.py --steps 300 --seed 0

writes benchmarks/RESULTS-soak.md (`--out`) and the raw figures beside it (`.json`). The engine
of it is tests/support/soak.py; tests/test_soak.py runs a short form of it in `make test`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.soak import SoakConfig, SoakRun, run_soak
from support.soak_checks import Report, evaluate

HERE = Path(__file__).resolve().parent


def markdown(run: SoakRun, report: Report, command: str) -> str:
    """RESULTS-soak.md's text for one run."""
    cfg = run.config
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=HERE,
    ).stdout.strip()
    met = sum(c.met for c in report.checks)
    lines = [
        "# Soak",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, commit {commit}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; shared with other work.",
        "",
        f"{cfg.steps} steps published by a trainer process (SDK `Publisher`, full snapshot every "
        f"{cfg.full_every}, `retain={cfg.retain}`) to SeaweedFS; {cfg.replicas} replicas "
        "(`python -m hotload_sidecar --report kubernetes --deployment policy` + `hotload serve`, "
        "default options), each reporting to a pod of the HotLoadDeployment `policy` on a real "
        "kube-apiserver (`../shared/k8s`, started for the soak; the soak plays the kubelet: a "
        "pod's Ready is its engine's /ready and the loader's SnapshotLoaded) and following its "
        "HotLoadHead; two operator processes (`python -m hotload_operator`, leader election on "
        "one Lease: 8 s lease, 6 s renew deadline). SeaweedFS outages of "
        f"{cfg.outage_seconds:g} s, API server outages of {cfg.apiserver_outage_seconds:g} s. "
        "Model: a tiny Llama, "
        f"{run.base_bytes / 2**20:.1f} MiB of float32 tensors; each step changes 0.5% of three "
        f"tensors (the embedding always). Wall time {run.wall_seconds / 60:.1f} min.",
        "",
        _vllm_line(run),
        "",
        "Retention is the trainer's Publisher `retain=` (no `--deployment` given to it: it keeps "
        "the last entries and the chain from the latest full snapshot, not what replicas serve), "
        f"deleting a dropped entry's files {cfg.retain_grace:g} s after it dropped them.",
        "",
        f"**{met} of {len(report.checks)} checks met.**",
        "",
        "| check | met | what was seen |",
        "| --- | --- | --- |",
    ]
    for c in report.checks:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")[:700]
        lines.append(f"| {c.name} | {'yes' if c.met else '**no**'} | {detail} |")
    lines += [f"| not judged: {why} | - | too short a run |" for why in report.not_judged]
    lines += ["", f"## Faults (seed {cfg.seed})", ""]
    lines += [f"- {f.label()}" for f in run.faults]
    lines += ["", "What happened:", "", "```", *run.fault_log, "```", ""]
    lines += [
        "## Publish -> serving",
        "",
        "Seconds from the trainer's publish returning to a client first answered from that "
        "snapshot or a newer one, per replica and step; a phase is the set of faults in force "
        "while the step was published ('any X': every step with X in force).",
        "",
        "| phase | samples | p50 s | p99 s |",
        "| --- | --- | --- | --- |",
    ]
    for phase, v in report.figures["latency"].items():
        lines.append(f"| {phase} | {v['n']} | {v['p50']} | {v['p99']} |")
    lines += [
        "",
        "## Processes",
        "",
        "Per component, its longest-lived process after the warm-up: the median, and the rise "
        "over the run of a least-squares fit against the step (+- two standard errors).",
        "",
        "| process | RSS MiB | RSS rise MiB | fds (max) | fds rise | sockets rise | samples | "
        "processes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, v in report.figures["processes"].items():
        lines.append(
            f"| {key} | {v['rss_mib']} | {v['rss_rise_mib']:+} +- {v['rss_rise_noise_mib']} | "
            f"{v['fds']:g} ({v['max_fds']}) | {v['fds_rise']:+} | {v['sockets_rise']:+} | "
            f"{v['samples']} over {v['span']} steps | {v['pids']} |"
        )
    lines += [
        "",
        "## Growth",
        "",
        "Each series fitted against the step after the warm-up (a volume and the bucket by the "
        "median of each chain):",
        "",
    ]
    lines += [f"- {name}: {what}" for name, what in report.figures["growth"].items()]
    lines += [f"- not judged, {what}" for what in report.figures["growth_not_judged"]]
    bucket = report.figures["bucket"]
    lines += [
        "",
        "## Volumes and bucket",
        "",
        "Largest weights folder while idle, in full snapshots: "
        + ", ".join(f"{k} {v}" for k, v in report.figures["volume_max_in_fulls"].items())
        + "; at any sample (mid-update included): "
        + ", ".join(f"{k} {v}" for k, v in report.figures["volume_max_any_sample_in_fulls"].items())
        + ".",
        "",
        f"Bucket: at most {bucket['max_folders']} snapshot folders (bound {bucket['folders_bound']}), "
        f"{bucket['max_objects']} objects, {bucket['max_bytes'] / 2**20:.1f} MiB "
        f"(bound {bucket['bytes_bound'] / 2**20:.1f} MiB); at the end {bucket['last_objects']} "
        f"objects, {(bucket['last_bytes'] or 0) / 2**20:.1f} MiB.",
        "",
        "## Idle CPU (% of one core, nothing to do, after the fleet reached the head)",
        "",
        "| process | CPU % |",
        "| --- | --- |",
    ]
    for k, v in report.figures["idle_cpu_percent"].items():
        lines.append(f"| {k} | {v} |")
    lines += _cluster_lines(report)
    lines.append("")
    return "\n".join(lines)


def _vllm_line(run: SoakRun) -> str:
    """What the results say about the vLLM replicas."""
    names = sorted(getattr(run, "vllm", set()))
    if not names:
        return "No vLLM replica in this run (`--vllm 0`): every engine is `hotload serve`."
    unversioned = getattr(run, "unversioned", {})
    moved = "; ".join(getattr(run, "retargeted", [])) or "none moved"
    return (
        f"vLLM CPU replicas: {', '.join(names)} (`.venv-vllm/`, dev mode, the hotload worker "
        "extension the loader copies to the volume, booted from `weights/current`; the pod's "
        "readiness probe is its `/health`). Their clients pair each completion with vLLM's "
        "weight version (`/weight_info` before and after it); answers from the weights a boot "
        "loaded, before the loader named them (`default`): "
        + (", ".join(f"{k} {v}" for k, v in sorted(unversioned.items())) or "none")
        + ". Their weights are compared through the extension's per-parameter sha256 with the "
        "trainer's in vLLM's layout (fused qkv and gate/up rows, vocabulary padded to 64 rows "
        f"with zeros); their processes are the API server, the engine core and its model worker. "
        f"Kills: {moved}."
    )


def _cluster_lines(report: Report) -> list[str]:
    """The control plane's figures: leader changes, Events per object."""
    if "events" not in report.figures:
        return []
    events = report.figures["events"]
    lines = ["", "## Control plane", ""]
    lines += [f"- {d}" for d in report.figures.get("deposals", [])]
    lines += [
        f"- HotLoadDeployment status looked at {report.figures.get('operator_status_looks')} "
        "times (one per step while the API server answered).",
        f"- Events at the end: {events['total']}, highest count {events['max_count']}; per "
        "object: " + ", ".join(f"{k} {v}" for k, v in events["per_object"].items()) + ".",
    ]
    if report.figures.get("processes_not_judged"):
        lines.append("- Not judged: " + "; ".join(report.figures["processes_not_judged"]) + ".")
    return lines


def figures(run: SoakRun, report: Report) -> dict[str, Any]:
    """The raw figures, for the JSON beside the results."""
    return {
        "config": {k: str(v) for k, v in vars(run.config).items()},
        "checks": [vars(c) for c in report.checks],
        "figures": report.figures,
        "faults": [f.label() for f in run.faults],
        "fault_log": run.fault_log,
        "published": {s: {"kind": p.kind, "attempts": p.attempts, "shipped_bytes": p.shipped_bytes}
                      for s, p in run.published.items()},
        "volume_per_step": [{"step": s.step, **s.volume} for s in run.samples],
        "bucket_per_step": [
            {"step": s.step, "objects": s.bucket_objects, "bytes": s.bucket_bytes}
            for s in run.samples
        ],
    }  # fmt: skip


def main() -> int:
    """Run the soak and write its results."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="steps published (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    ap.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    ap.add_argument(
        "--vllm",
        type=int,
        default=1,
        help="how many of the replicas (the last ones) run a vLLM CPU engine (default 1; "
        "needs .venv-vllm/ from scripts/install_vllm.sh; 0: reference engines only)",
    )
    ap.add_argument("--full-every", type=int, default=25, help="a full snapshot every N steps")
    ap.add_argument("--retain", type=int, default=8, help="the Publisher's retain= (gc --keep)")
    ap.add_argument(
        "--retain-grace",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long the Publisher keeps a dropped entry's files (default 600: a shorter run "
        "deletes none)",
    )
    ap.add_argument("--outage-seconds", type=float, default=30.0, help="SeaweedFS stopped for")
    ap.add_argument("--idle-seconds", type=float, default=30.0, help="idle CPU window")
    ap.add_argument(
        "--apiserver-outage-seconds",
        type=float,
        default=15.0,
        help="kube-apiserver stopped for (default 15)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS-soak.md", help="results file")
    ap.add_argument("--workdir", type=Path, help="keep the run's files here (default: temporary)")
    ap.add_argument(
        "--evaluate",
        type=Path,
        metavar="RUN.pickle",
        help="judge a run saved by an earlier --workdir run (its run.pickle) instead of running",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.evaluate is not None:
        with args.evaluate.open("rb") as f:
            saved = pickle.load(f)  # a file this script wrote
        return report_run(saved["run"], saved["command"], args.out)
    command = "python benchmarks/soak.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="hotload-soak-", ignore_cleanup_errors=True) as tmp:
        # Everything the run starts gets its temp files here, removed with it: operators and
        # engines it SIGKILLs leave theirs (secrets, vLLM's sockets) where they were. A short
        # path: unix socket paths must stay under 108 bytes.
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = None
        cfg = SoakConfig(
            root=args.workdir or Path(tmp),
            steps=args.steps,
            seed=args.seed,
            replicas=args.replicas,
            vllm=args.vllm,
            full_every=args.full_every,
            retain=args.retain,
            retain_grace=args.retain_grace,
            outage_seconds=args.outage_seconds,
            idle_seconds=args.idle_seconds,
            apiserver_outage_seconds=args.apiserver_outage_seconds,
        )
        try:
            run = run_soak(cfg)
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
            tempfile.tempdir = None
        if args.workdir is not None:
            with (args.workdir / "run.pickle").open("wb") as f:
                pickle.dump({"run": run, "command": command}, f)
    return report_run(run, command, args.out)


def report_run(run: SoakRun, command: str, out: Path) -> int:
    """Judge `run`, write its results to `out` (and the JSON beside it), print the checks."""
    report = evaluate(run)
    args_out = out
    args_out.write_text(markdown(run, report, command))
    args_out.with_suffix(".json").write_text(json.dumps(figures(run, report), indent=1) + "\n")
    for c in report.checks:
        print(f"{'met   ' if c.met else 'MISSED'} {c.name}: {c.detail[:300]}")
    return 0 if not report.missed() else 1


if __name__ == "__main__":
    sys.exit(main())
