"""Two releases' CPU per BatchPredict row, measured in lockstep: ``bench/batch_cpu.py`` passes of
A (another checkout) and B (this one), taken in turn by two long-lived processes.

A benchmark, not a test: it reports numbers and asserts no speed.

Why: this machine kind's speed moves the same code by up to 1.8 × within minutes, so two runs
of ``batch_cpu.py`` one after the other (or a round of each) compare moments as much as code.
Here both sides are set up once (service, throw-away ledger and CRM, relay, payloads), then in
each round one pass of A and one of B run back to back, which goes first alternating by round.
Adjacent passes see nearly the same machine, so the ratio B ÷ A of each round is steadier than
either side's figures; the median of the rounds' ratios is the result.

The A side imports the project from ``--baseline`` (a commit, checked out with ``git worktree``
under ``var/bench/ab/`` and, for a release that had C parts (a ``setup.py``), those built in
place, or a folder holding a checkout) through
``bench/ab_tree/sitecustomize.py``; the harness itself (``batch_cpu.py``'s service set-up,
payloads and clocks) is this checkout's on both sides. Each side is its own process with its
own database and, with ``--relay-process``, its own relay process. The worktrees stay for the
next run; ``git worktree remove var/bench/ab/<commit>`` removes one. Other arguments are
``batch_cpu.py``'s (``--calls`` per pass, ``--relay-process``, ``--concurrency`` …). With a
PostgreSQL ledger each row also gives each side's ``postgres_cpu_us_per_row``: the database
server's CPU across that side's pass (the other side is idle then, but for its relay's polls).

    .venv/bin/python bench/ab_lockstep.py --baseline 6acc9ef --rounds 12 --calls 40 --relay-process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# figures a pass reports only in some setups (--relay-process; a PostgreSQL ledger), shown per side
OPTIONAL_FIGURES = ("relay_process_cpu_us_per_row", "postgres_cpu_us_per_row")
if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(ROOT))


def checkout(baseline: str) -> Path:
    """The folder of ``baseline``: itself when it is a folder, else a worktree of the commit under
    ``var/bench/ab/`` (made on first use), with its C parts built in place where it has any (a
    release before they were removed: a ``setup.py``).

    Raises:
        subprocess.CalledProcessError: git does not know the commit, or the build failed.
    """
    if Path(baseline).is_dir():
        return Path(baseline).resolve()
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{baseline}^{{commit}}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = ROOT / "var" / "bench" / "ab" / sha[:12]
    if not tree.is_dir():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True, capture_output=True
        )
    if (tree / "setup.py").is_file():
        subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=tree, check=True, capture_output=True
        )
    return tree


def tree_env(tree: Path | None) -> dict[str, str]:
    """This process's environment for a worker that imports the project from ``tree`` (another
    checkout, through ``bench/ab_tree``), or from this checkout when ``tree`` is None."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench" / "ab_tree"), env.get("PYTHONPATH")]))
        env["MLPAIR_AB_TREE"] = str(tree)
    return env


class Side:
    """One side's worker process: ``--worker`` mode of this script, one JSON line per pass."""

    def __init__(self, name: str, tree: Path | None, bench_args: list[str]) -> None:
        env = tree_env(tree)
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", *bench_args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"side {self.name}: the worker exited (code {self.process.wait()})")
        return json.loads(line)

    def one_pass(self) -> dict:
        self.process.stdin.write("pass\n")
        self.process.stdin.flush()
        return self.answer()

    def stop(self) -> None:
        """Asks the worker to tear down (its database and relay) and waits for it to exit."""
        if self.process.poll() is not None:
            return
        try:
            self.process.stdin.write("stop\n")
            self.process.stdin.close()
        finally:
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def worker(bench_argv: list[str]) -> int:
    """One side: batch_cpu's set-up, then a pass each time the parent writes ``pass``."""
    from bench import batch_cpu

    args = batch_cpu.parse_args(bench_argv)

    async def gate(last: dict | None) -> bool:
        if last is None:  # set up: say which checkout the project was imported from
            import mlpair.contracts

            last = {"ready": True, "project": str(Path(mlpair.contracts.__file__).resolve().parents[2])}
        print(json.dumps(last), flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # outside the pass's clock
        return line.strip() == "pass"

    print(json.dumps(batch_cpu.run(args, gate)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--baseline", required=True, help="A: a commit, or a folder holding a checkout")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of one A pass and one B pass")
    parser.add_argument("--b-args", default="",
                        help="batch_cpu.py arguments for B alone, after the shared ones (e.g. '--rpc columns "
                             "--batch-items 10000 --calls 4': another RPC of this release against A's)")
    args, bench_args = parser.parse_known_args(argv)
    tree = checkout(args.baseline)
    bench_args = [*bench_args, "--repeats", str(args.rounds)]  # enough payloads for every round's pass
    b_args = [*bench_args, *shlex.split(args.b_args)]
    from bench import batch_cpu

    # trained here, once: two sides finding no model would both train it into the same folder
    batch_cpu.harness.trained_model(Path(batch_cpu.parse_args(bench_args).model_repository).resolve())
    sides = {"A": Side("A", tree, bench_args), "B": Side("B", None, b_args)}
    rounds = []
    try:
        for side, project in zip(sides.values(), (tree, ROOT)):
            ready = side.answer()  # set up and warmed
            if Path(ready["project"]) != project:
                raise RuntimeError(f"side {side.name} imported the project from {ready['project']}, not {project}")
        for r in range(args.rounds):
            order = "AB" if r % 2 == 0 else "BA"
            figures = {name: sides[name].one_pass() for name in order}
            row = {
                "round": r + 1,
                "order": order,
                **{f"{n}_cpu_us_per_row": figures[n]["cpu_us_per_row"] for n in "AB"},
                **{f"{n}_gc_us_per_row": figures[n]["gc_us_per_row"] for n in "AB"},
                **{f"{n}_{key}": figures[n][key] for key in OPTIONAL_FIGURES for n in "AB" if key in figures[n]},
            }
            row["B_over_A"] = round(row["B_cpu_us_per_row"] / row["A_cpu_us_per_row"], 3)
            rounds.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for side in sides.values():
            side.stop()
    ratios = [r["B_over_A"] for r in rounds]
    print(
        json.dumps(
            {
                "bench": "ab_lockstep",
                "baseline": args.baseline,
                "baseline_tree": str(tree),
                "bench_args": bench_args,
                **({"b_args": b_args} if args.b_args else {}),
                "rounds": len(rounds),
                "A_cpu_us_per_row_median": statistics.median(r["A_cpu_us_per_row"] for r in rounds),
                "B_cpu_us_per_row_median": statistics.median(r["B_cpu_us_per_row"] for r in rounds),
                "A_gc_us_per_row_median": statistics.median(r["A_gc_us_per_row"] for r in rounds),
                "B_gc_us_per_row_median": statistics.median(r["B_gc_us_per_row"] for r in rounds),
                **{
                    f"{n}_{key}_median": statistics.median(r[f"{n}_{key}"] for r in rounds)
                    for key in OPTIONAL_FIGURES
                    for n in "AB"
                    if rounds and f"{n}_{key}" in rounds[0]
                },
                "B_over_A_median": statistics.median(ratios),
                "B_over_A_range": [min(ratios), max(ratios)],
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
