"""What the text tests' scripts share: a fresh work folder, checks that are counted rather than
stopping at the first, programs run in the work folder, token files of examples read back. A
script calls start(WORK) first and finish(WHAT) last.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

work = None
failures = []


def start(folder):
    """Makes `folder` (empty) the work folder; returns its absolute path."""
    global work
    work = os.path.abspath(folder)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    return work


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)
    return cond


def run(prog, args, rc=0):
    """Runs a program in the work folder; checks its exit status; returns its output."""
    p = subprocess.run([prog] + args, cwd=work, capture_output=True, text=True)
    check(p.returncode == rc,
          f"{os.path.basename(prog)} {' '.join(args)}: exit {p.returncode}, expected {rc}\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def write_jsonl(name, records):
    with open(os.path.join(work, name), "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return name


def read_examples(path, width=4):
    """(ids, mask, index) of a token file of examples."""
    p = os.path.join(work, path)
    data = open(p, "rb").read()
    ids = list(struct.unpack(f"<{len(data) // width}{'I' if width == 4 else 'H'}", data))
    mask = list(open(p + ".mask", "rb").read())
    raw = open(p + ".idx", "rb").read()
    check(len(raw) % 8 == 0, f"{path}.idx: {len(raw)} bytes, not int64s")
    index = list(struct.unpack(f"<{len(raw) // 8}q", raw))
    return ids, mask, index


def split(ids, mask, index):
    """Per example: (ids, mask)."""
    return [(ids[index[e]:index[e + 1]], mask[index[e]:index[e + 1]]) for e in range(len(index) - 1)]


def finish(what):
    """Exits 1 naming the count of failed checks, else says that `what` passed."""
    if failures:
        sys.exit(f"{len(failures)} checks failed")
    print(f"{what}: all checks passed")
