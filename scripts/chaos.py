#!/usr/bin/env python
"""Kill `jaxmp train` with SIGKILL at random moments, restart it, and check nothing was lost.

    python scripts/chaos.py                          # K=20 kills, 1 process x 4 simulated devices
    python scripts/chaos.py --processes 2 --simulate-devices 2   # 2 processes x 2 devices (gloo)
    python scripts/chaos.py --kills 3 --steps 30 --json  # what the test suite runs

First an uninterrupted run of the config (the reference), then the same config in another run
directory, killed K times with SIGKILL and restarted after each kill. The moments rotate over
four kinds, in shuffled order:

- ``startup``: at a random time before the run's first step (imports, planning, compiling,
  restoring);
- ``mid-step``: at a random time while steps run;
- ``mid-save``: just after an asynchronous checkpoint save started writing (its
  ``*.orbax-checkpoint-tmp-*`` folder appeared), before it committed;
- ``first-save``: the same, during the first save of this incarnation (the very first kill is
  always this one: the run's first-ever checkpoint, when there is nothing to fall back to).

With several processes, a kill hits either every process (a lost job) or one random process (a
lost host); then the others must exit on their own within 60 s, with a clear message.

After the last restart the run goes to the end. The check: every restart resumed from the
newest complete checkpoint; the final params, optimizer state and every other array have the
same sha256 as the reference (``jaxmp ckpt inspect --digest``); metrics.jsonl holds each step
once, with the reference's losses bit for bit. Exit 0 when all of that holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("startup", "mid-step", "mid-save", "first-save")
SURVIVOR_LIMIT_S = 60.0
LOST_MESSAGES = ("lost contact with another process", "another task died")
STEP_LINE = re.compile(r"^step +\d+/\d+", re.M)
RESUMED = re.compile(r"resuming from checkpoint step (\d+)")
BASE = ["model.layers=2", "model.d_model=64", "model.heads=4", "data.seq_len=64",
        "train.batch_size=8", "train.eval_every=10", "train.eval_batches=2", "logging.every=1",
        "checkpoint.every=4", "checkpoint.keep=2", "mesh.data=2", "mesh.fsdp=-1",
        "optimizer.warmup_steps=5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One incarnation of the training job: its processes, their logs, when it started."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, logs: Path, name: str):
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        if args.cache:
            env["JAX_COMPILATION_CACHE_DIR"] = str(args.cache)
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        sets = [a for kv in BASE + [f"train.steps={args.steps}"] + args.set for a in ("--set", kv)]
        port = free_port()
        self.procs, self.logs = [], []
        for i in range(args.processes):
            cmd = [sys.executable, "-m", "jaxmp.cli", "train", *sets, "--run-dir", str(run_dir),
                   "--simulate-devices", str(args.simulate_devices)]
            if args.processes > 1:
                cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                        str(args.processes), "--process-id", str(i)]
            log = logs / f"{name}.p{i}.log"
            with open(log, "w") as fh:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh,
                                                   stderr=subprocess.STDOUT))
            self.logs.append(log)
        self.started = time.monotonic()
        self.first_step_s: float | None = None  # seconds to the first step, when seen

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def log(self, i: int = 0) -> str:
        return self.logs[i].read_text(errors="replace")

    def stepping(self) -> bool:
        return bool(STEP_LINE.search(self.log(0)))

    def kill(self, which: list[int]) -> None:
        for i in which:
            if self.procs[i].poll() is None:
                self.procs[i].send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> list[int | None]:
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]


def saving(ckdir: Path) -> set[str]:
    """Names of checkpoint folders being written right now (Orbax's tmp folders)."""
    try:
        return {p.name for p in ckdir.iterdir() if ".orbax-checkpoint-tmp" in p.name}
    except FileNotFoundError:
        return set()


def complete_steps(run_dir: Path) -> list[int]:
    from jaxmp.checkpoint import store  # noqa: PLC0415 - jax only once the runs are planned

    return store.complete_steps(run_dir / "checkpoints")


def wait_for_moment(run: Run, kind: str, ckdir: Path, rng: random.Random,
                    startup_s: float, step_s: float) -> bool:
    """Sleep until a moment of ``kind`` (True), or until the run ended first (False)."""
    if kind == "startup":
        deadline = time.monotonic() + rng.uniform(0.0, 0.9 * startup_s)
        while time.monotonic() < deadline and run.alive():
            time.sleep(0.005)
        return run.alive() and not run.stepping()
    if kind == "mid-step":
        while not run.stepping():
            if not run.alive():
                return False
            time.sleep(0.01)
        run.first_step_s = time.monotonic() - run.started
        time.sleep(rng.uniform(0.0, 8 * step_s))
        return run.alive()
    seen = saving(ckdir)  # mid-save / first-save: a new tmp folder appears
    while run.alive():
        now = saving(ckdir)
        if now - seen:
            time.sleep(rng.uniform(0.0, 0.02))
            return run.alive()
        seen = now
        time.sleep(0.001)
    return False


def digests(run_dir: Path, step: int) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "jaxmp.cli", "ckpt", "inspect", str(run_dir),
                          "--step", str(step), "--digest", "--json"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                                              "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(f"chaos: jaxmp ckpt inspect failed: {out.stderr.strip()}")
    return {p: a["sha256"] for p, a in json.loads(out.stdout)["arrays"].items()}


def metrics(run_dir: Path) -> tuple[list[dict], int]:
    """Records of metrics.jsonl and the number of lines that are not whole JSON."""
    good, bad = [], 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            good.append(json.loads(line))
        except ValueError:
            bad += 1
    return good, bad


def reference_run(args: argparse.Namespace, work: Path) -> tuple[Path, float, float]:
    """The uninterrupted run: its directory, time to its first step, seconds per step."""
    run_dir = work / "reference"
    run = Run(args, run_dir, work / "logs", "reference")
    first = None
    while run.alive():
        if first is None and run.stepping():
            first = time.monotonic() - run.started
        time.sleep(0.01)
    codes = run.wait(5)
    if any(codes):
        raise SystemExit(f"chaos: the reference run failed ({codes}):\n{run.log()[-3000:]}")
    total = time.monotonic() - run.started
    first = first or total
    return run_dir, first, max((total - first) / args.steps, 0.01)


def chaos_run(args: argparse.Namespace, work: Path, startup_s: float, step_s: float) -> dict:
    rng = random.Random(args.seed)
    run_dir, ckdir = work / "chaos", work / "chaos" / "checkpoints"
    plan = ["first-save"] + [KINDS[i % len(KINDS)] for i in range(args.kills - 1)]
    plan[1:] = rng.sample(plan[1:], len(plan) - 1)
    report: dict = {"kills_attempted": 0, "kills_landed": 0, "by_kind": {k: 0 for k in KINDS},
                    "restarts_judged": 0, "resumes_ok": 0, "resume_problems": [],
                    "survivors": [], "events": []}
    for n, kind in enumerate(plan + [None]):
        before = complete_steps(run_dir) if run_dir.exists() else []
        run = Run(args, run_dir, work / "logs", f"chaos{n:02d}")
        if kind is None:  # the last incarnation runs to the end
            codes = run.wait(args.timeout)
            if any(c is None for c in codes):
                run.kill(list(range(args.processes)))
                report["final"] = f"timed out after {args.timeout} s"
            else:
                report["final"] = "finished" if not any(codes) else f"exit codes {codes}"
        else:
            report["kills_attempted"] += 1
            landed = wait_for_moment(run, kind, ckdir, rng, startup_s, step_s)
            victims = list(range(args.processes))
            # One process of several: a lost host. (Not at start-up: a process that never
            # joined is waited for by the others for JAX's whole join timeout.)
            if landed and args.processes > 1 and kind != "startup" and rng.random() < 0.5:
                victims = [rng.randrange(args.processes)]
            run.kill(victims)
            if run.first_step_s:  # restarts compile from the cache: start-up gets shorter
                startup_s = min(startup_s, run.first_step_s)
            report["events"].append({"kind": kind, "landed": landed, "victims": victims,
                                     "at_s": round(time.monotonic() - run.started, 3)})
            if landed:
                report["kills_landed"] += 1
                report["by_kind"][kind] += 1
            others = [i for i in range(args.processes) if i not in victims]
            if others:  # the survivors must leave on their own, with a clear message
                t0 = time.monotonic()
                codes = run.wait(SURVIVOR_LIMIT_S)
                took = round(time.monotonic() - t0, 2)
                report["survivors"] += [{"process": i, "exited": codes[i] is not None,
                                         "seconds": took, "code": codes[i],
                                         "clear": lost_peer(run.log(i))} for i in others]
                run.kill(others)
            run.wait(30)
        if n:
            verdict = judge_resume(run.log(0), before)
            if verdict != "unjudged":
                report["restarts_judged"] += 1
                report["resumes_ok"] += verdict == "ok"
            if verdict == "bad":
                report["resume_problems"].append(
                    {"restart": n, "expected_step": before[-1] if before else None,
                     "log_tail": run.log(0)[-600:]})
    return report


def judge_resume(text: str, before: list[int]) -> str:
    """"ok" if the incarnation resumed from the newest complete step (or started fresh when
    there was none), "bad" if not or if it failed, "unjudged" if killed before restoring."""
    m = RESUMED.search(text)
    if m:
        return "ok" if before and int(m.group(1)) == before[-1] else "bad"
    if re.search(r"^jaxmp: (error|failed)", text, re.M) and not lost_peer(text):
        return "bad"
    if STEP_LINE.search(text) or "jaxmp: done" in text:
        return "bad" if before else "ok"
    return "unjudged"


def lost_peer(text: str) -> bool:
    return any(m in text for m in LOST_MESSAGES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs (default %(default)s)")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--simulate-devices", type=int, default=4, metavar="N",
                   help="simulated CPU devices per process (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="default: 8 x kills + 16")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill schedule")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for both runs")
    p.add_argument("--out", type=Path, default=None, help="work folder (default: a temp dir)")
    p.add_argument("--no-cache", dest="cache", action="store_false",
                   help="no persistent JAX compilation cache (slower restarts)")
    p.add_argument("--timeout", type=float, default=900, help="limit for the final run (s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    args.steps = args.steps or 8 * args.kills + 16
    work = args.out or Path(tempfile.mkdtemp(prefix="jaxmp-chaos-"))
    for sub in ("reference", "chaos", "logs"):
        shutil.rmtree(work / sub, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    args.cache = (work / "jax-cache") if args.cache else None

    t0 = time.monotonic()
    ref_dir, startup_s, step_s = reference_run(args, work)
    report = chaos_run(args, work, startup_s, step_s)
    final = complete_steps(work / "chaos")
    report["final_step"] = final[-1] if final else None
    ok = report.get("final") == "finished" and report["final_step"] == args.steps
    if ok:
        want, got = digests(ref_dir, args.steps), digests(work / "chaos", args.steps)
        report["arrays"] = len(want)
        report["arrays_equal"] = sum(got.get(k) == v for k, v in want.items())
        report["arrays_by_part"] = {part: sum(k.split("/")[0] == part for k in want)
                                    for part in sorted({k.split("/")[0] for k in want})}
    ref_metrics, _ = metrics(ref_dir)
    got_metrics, broken = metrics(work / "chaos")
    report["metric_lines_broken"] = broken
    report["metric_steps"] = [r["step"] for r in got_metrics] == [r["step"] for r in ref_metrics]
    report["losses_equal"] = sum(a.get("loss") == b.get("loss")
                                 for a, b in zip(got_metrics, ref_metrics))
    report["steps"] = args.steps
    survivors = report["survivors"]
    report["passed"] = bool(
        ok and report["arrays_equal"] == report["arrays"] and not broken
        and report["metric_steps"] and report["losses_equal"] == len(ref_metrics)
        and report["resumes_ok"] == report["restarts_judged"] and not report["resume_problems"]
        and all(s["exited"] and s["clear"] for s in survivors))
    report.update(seconds=round(time.monotonic() - t0, 1), work=str(work),
                  processes=args.processes, devices=args.simulate_devices, kills=args.kills)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(summary(report))
    return 0 if report["passed"] else 1


def summary(r: dict) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in r["by_kind"].items())
    lines = [f"chaos: {r['kills']} SIGKILLs on {r['processes']} process(es) x {r['devices']} "
             f"devices, {r['steps']} steps ({r['seconds']:.0f} s, work dir {r['work']})",
             f"  kills attempted: {r['kills_attempted']} (landed {r['kills_landed']}: {kinds})",
             f"  resumes succeeded: {r['resumes_ok']}/{r['restarts_judged']} (restarts that got "
             f"as far as restoring; the others were killed again during start-up)"]
    if r["survivors"]:
        s = r["survivors"]
        lines.append(f"  survivors that exited on their own with a clear message: "
                     f"{sum(x['exited'] and x['clear'] for x in s)}/{len(s)} (slowest "
                     f"{max(x['seconds'] for x in s):.1f} s)")
    if "arrays" in r:
        parts = ", ".join(f"{k} {v}" for k, v in r["arrays_by_part"].items())
        lines.append(f"  arrays equal: {r['arrays_equal']}/{r['arrays']} ({parts})")
    lines.append(f"  metrics.jsonl: broken lines {r['metric_lines_broken']}, same steps "
                 f"{r['metric_steps']}, losses equal {r['losses_equal']}/{r['steps']}")
    for prob in r["resume_problems"]:
        lines.append(f"  resume problem at restart {prob['restart']}: expected step "
                     f"{prob['expected_step']}: ...{prob['log_tail'][-300:]}")
    lines.append(f"  final run: {r.get('final')}; {'PASS' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
