#!/usr/bin/env python3
"""The README's two Quick start commands are what a fresh machine needs (issue 51):

- its first command installs every package CI's `.ci/run` installs for the build and the tests,
  except the optional ones, whose tests skip where they are absent (OPTIONAL below); then it builds
  the program alone (`--target megatrain-train`, not every test: issue 52) and runs it;
- its second command is the test command CI runs (`cmake --workflow --preset release`).

    readme_install.py REPO
"""
import re
import sys

# Installed by CI for checks that skip cleanly where the tool is absent (each test says so).
OPTIONAL = {"chromium": "report.html rendered in headless Chromium (tests/report: skipped without it)"}


def packages(command):
    m = re.search(r"apt-get install -y (?:--no-install-recommends )?(.*?)(?:&&|$)", command, re.S)
    if not m:
        sys.exit(f"no `apt-get install -y` in: {command[:200]}")
    return {p for p in re.split(r"[\s\\]+", m.group(1)) if p and not p.startswith("-")}


repo = sys.argv[1]
readme = open(f"{repo}/README.md", encoding="utf-8").read()
quick = re.search(r"## Quick start.*?```bash\n(.*?)\n```", readme, re.S)
if not quick:
    sys.exit("README.md has no Quick start block")
lines = quick.group(1).splitlines()
if len(lines) != 2:
    sys.exit(f"the Quick start block holds {len(lines)} commands, not two")
first, second = lines
ci = open(f"{repo}/.ci/run", encoding="utf-8").read()
ci_install = re.search(r"apt-get install -y.*?\n(?!\s)", ci, re.S).group(0)
missing = packages(ci_install) - packages(first) - set(OPTIONAL)
if missing:
    sys.exit(f"CI installs {sorted(missing)}, which the README's first command does not: on a fresh machine its second "
             f"command would lack them")
build = re.search(r"cmake --build --preset release --target megatrain-train &&\s*(\S+)\s*$", first)
if not build or not build.group(1).endswith("/megatrain-train"):
    sys.exit("the README's first command does not build the program alone (`cmake --build --preset release --target "
             "megatrain-train`) and then run it")
if second.strip() != "cmake --workflow --preset release" or "cmake --workflow --preset release" not in ci:
    sys.exit(f"the README's second command ({second!r}) is not the test command CI runs")
for p, why in OPTIONAL.items():
    print(f"optional: {p}: {why}")
print(f"ok: the first command installs {len(packages(first))} packages, every one CI's tests need")
