#!/usr/bin/env python3
"""RL rollouts by fork: set up a task once, fork the initialised VM into one rollout per
candidate action, score each, then fork again from the best rollout and go on from its state.

The task (made by the template's setup, so every rollout starts from the same snapshot):
`/task/solve.sh` must print the numbers it reads, one per line, in ascending numeric order;
`/task/test.sh` runs it on the cases in /task/cases, writes the score to /task/score and
exits 0 only if every case passes. A rollout's action is a candidate `solve.sh` (a "patch")
followed by the test run; its reward is the fraction of cases passed, read back from the
file the test wrote. Round 2 starts from the best rollout's VM (its patch in place) and tries
follow-up patches against a harder test set.

    python3 examples/rl_rollouts.py --sock /run/mayfly.sock --state-dir /var/lib/mayfly

(or set MAYFLY_SOCK and MAYFLY_STATE_DIR). Needs `mayfly serve` with its default guest.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import List, Tuple

from mayfly import Template
from mayfly.aio import AsyncClient, AsyncSandbox

CASES = {
    "1": "3 1 2",
    "2": "10 9 100",
    "3": "5 5 1",
    "4": "-2 7 0",
    "5": "42",
    "6": "8 80 800 8000 9",
}
HARD_CASES = {
    "7": "3  1\t2",  # runs of blanks and tabs between numbers
    "8": "2 2 2 1",
    "9": "",
}

TEST_SH = r"""#!/bin/sh
# Scores /task/solve.sh against every case in $1 (default /task/cases).
dir=${1:-/task/cases}; pass=0; total=0
for input in "$dir"/*.in; do
    total=$((total + 1))
    want=$(tr -s ' \t' '\n\n' < "$input" | grep -v '^$' | sort -n)
    got=$(sh /task/solve.sh < "$input" 2>/dev/null)
    [ "$got" = "$want" ] && pass=$((pass + 1))
done
echo "$pass $total" > /task/score
echo "passed $pass of $total"
[ "$pass" -eq "$total" ]
"""

# Round 1's actions: candidate solutions, some wrong in instructive ways.
CANDIDATES = [
    ("tr ' ' '\\n' | sort", "lexicographic sort"),
    ("tr ' ' '\\n' | sort -n", "numeric sort"),
    ("tr ' ' '\\n' | sort -rn", "descending"),
    ("tr ' ' '\\n' | sort -n | uniq", "drops duplicates"),
    ("cat", "no-op"),
    ("tr ' ' '\\n'", "unsorted split"),
]
# Round 2's actions, from the best rollout: filters put in front of its own solve.sh.
FOLLOW_UPS = [
    ("tr -s ' \\t' '\\n\\n' | grep -v '^$'", "squeeze blanks and tabs"),
    ("tr '\\t' ' '", "tabs to spaces"),
    ("cat", "unchanged"),
]


def template() -> Template:
    setup = ["mkdir -p /task/cases /task/hard", f"cat > /task/test.sh <<'EOF'\n{TEST_SH}EOF"]
    for where, cases in (("cases", CASES), ("hard", HARD_CASES)):
        for name, text in cases.items():
            setup.append(f"printf '%s' '{text}' > /task/{where}/{name}.in")
    setup.append("echo 'cat' > /task/solve.sh")
    return Template(setup=setup)


async def rollout(sb: AsyncSandbox, patch: str, tests: str) -> Tuple[float, float, str]:
    """Apply `patch` (write solve.sh), run the tests; (reward, ms, test output)."""
    start = time.monotonic()
    await sb.files.write("/task/solve.sh", patch + "\n")
    result = await sb.exec(f"sh /task/test.sh {tests}", timeout=60)
    passed, total = (await sb.files.read_text("/task/score")).split()
    return int(passed) / int(total), (time.monotonic() - start) * 1000, result.stdout.strip()


def table(title: str, rows: List[Tuple[str, str, float, float]]) -> None:
    print(f"\n{title}")
    print(f"  {'rollout':<14} {'action':<26} {'reward':>6} {'ms':>8}")
    for name, action, reward, ms in rows:
        print(f"  {name:<14} {action:<26} {reward:>6.2f} {ms:>8.1f}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sock", help="the manager's socket (default: $MAYFLY_SOCK)")
    parser.add_argument("--state-dir", help="its state dir, for the admin token")
    parser.add_argument("--token", help="the admin token (default: $MAYFLY_TOKEN)")
    parser.add_argument("--name", default="rl-task")
    args = parser.parse_args()
    client = AsyncClient(sock=args.sock, token=args.token, state_dir=args.state_dir)

    t0 = time.monotonic()
    task = await AsyncSandbox.create(template(), name=args.name, client=client)
    created_ms = (time.monotonic() - t0) * 1000
    made = [task]
    try:
        # Round 1: one rollout per candidate, all forked from the task's initial state.
        t0 = time.monotonic()
        rollouts = await task.fork(len(CANDIDATES))
        fork_ms = (time.monotonic() - t0) * 1000
        made += rollouts
        t0 = time.monotonic()
        scored = await asyncio.gather(
            *(rollout(sb, patch, "/task/cases") for sb, (patch, _) in zip(rollouts, CANDIDATES))
        )
        round1_ms = (time.monotonic() - t0) * 1000
        rows = [(sb.name, why, r, ms) for sb, (_, why), (r, ms, _) in zip(rollouts, CANDIDATES, scored)]
        print(f"task sandbox {task.name} ready in {created_ms:.0f} ms; forked into "
              f"{len(rollouts)} rollouts in {fork_ms:.0f} ms; all scored in {round1_ms:.0f} ms")
        table("round 1: candidate patches against /task/cases", rows)
        best_i = max(range(len(rows)), key=lambda i: (rows[i][2], -i))
        best = rollouts[best_i]
        print(f"\nbest: {best.name} ({rows[best_i][1]}, reward {rows[best_i][2]:.2f})")
        # The losers are done; free them before the next round.
        await asyncio.gather(*(sb.delete() for sb in rollouts if sb is not best))
        made = [task, best]

        # Round 2: forked from the best rollout, whose solve.sh is already in place.
        kept = (await best.files.read_text("/task/solve.sh")).strip()
        t0 = time.monotonic()
        second = await best.fork(len(FOLLOW_UPS))
        fork2_ms = (time.monotonic() - t0) * 1000
        made += second
        scored2 = await asyncio.gather(
            *(rollout(sb, f"{pre} | {kept}", "/task/hard") for sb, (pre, _) in zip(second, FOLLOW_UPS))
        )
        rows2 = [(sb.name, why, r, ms) for sb, (_, why), (r, ms, _) in zip(second, FOLLOW_UPS, scored2)]
        table(f"round 2: from {best.name} (forked in {fork2_ms:.0f} ms), against /task/hard", rows2)
        top = max(rows2, key=lambda row: row[2])
        print(f"\nbest of round 2: {top[0]} ({top[1]}, reward {top[2]:.2f})")
        return 0
    finally:
        await asyncio.gather(*(sb.delete() for sb in made), return_exceptions=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
