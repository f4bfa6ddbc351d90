#!/usr/bin/env python3
"""The house's rules that keep the step easy to change (issue 52), checked on the source tree:

- include/megatrain/train/trainer.hpp is at most 500 lines: the public API and the schedule;
- no function in include/megatrain/train/, include/megatrain/plan/, examples/ or src/app/ runs
  over 100 lines, as universal-ctags measures them (`ctags --fields=+ne`);
- no folder of include/megatrain/ includes a folder that includes it back (directly or not).

    house_rules.py REPO
Exit 77 (skipped) where universal-ctags is absent; the other two rules are checked anyway.
"""
import os
import re
import shutil
import subprocess
import sys

repo = sys.argv[1]
failures = []

trainer = os.path.join(repo, "include/megatrain/train/trainer.hpp")
lines = sum(1 for _ in open(trainer, encoding="utf-8"))
if lines > 500:
    failures.append(f"include/megatrain/train/trainer.hpp has {lines} lines (at most 500: move a part to its own file)")

# Include folders: an edge A -> B where a header under include/megatrain/A includes megatrain/B/...
inc = os.path.join(repo, "include/megatrain")
edges = {}
for folder in sorted(os.listdir(inc)):
    path = os.path.join(inc, folder)
    if not os.path.isdir(path):
        continue
    for root, _, files in os.walk(path):
        for f in files:
            text = open(os.path.join(root, f), encoding="utf-8").read()
            for m in re.finditer(r'#include "megatrain/([^/"]+)/', text):
                if m.group(1) != folder:
                    edges.setdefault(folder, set()).add(m.group(1))


def reaches(start):
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


for folder in sorted(edges):
    if folder in reaches(folder):
        failures.append(f"include/megatrain/{folder}/ includes a folder that includes it back: "
                        f"{folder} -> {sorted(edges[folder])}")

skipped = False
ctags = shutil.which("ctags")
version = subprocess.run([ctags, "--version"], capture_output=True, text=True).stdout if ctags else ""
if "Universal Ctags" not in version:
    print("SKIP the function lengths: universal-ctags is not installed (Debian: universal-ctags)")
    skipped = True
else:
    folders = ["include/megatrain/train", "include/megatrain/plan", "examples", "src/app"]
    out = subprocess.run([ctags, "-R", "--fields=+ne", "--kinds-c++=f", "-f", "-"] + folders, cwd=repo,
                         capture_output=True, text=True, check=True).stdout
    longest = 0
    for row in out.splitlines():
        cols = row.split("\t")
        fields = dict(c.split(":", 1) for c in cols[3:] if ":" in c)
        if "line" in fields and "end" in fields:
            n = int(fields["end"]) - int(fields["line"]) + 1
            longest = max(longest, n)
            if n > 100:
                failures.append(f"{cols[1]}:{fields['line']}: {cols[0]} runs {n} lines (at most 100: split it into named phases)")
    print(f"ok: the longest function in {', '.join(folders)} runs {longest} lines")

for f in failures:
    print(f"FAIL {f}")
if failures:
    sys.exit(1)
print(f"ok: trainer.hpp {lines} lines; {len(edges)} include folders, no cycle")
sys.exit(77 if skipped else 0)
