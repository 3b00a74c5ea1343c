#!/usr/bin/env python3
"""Runs the tests listed in an unpacked GPU bundle's manifest.json (deploy/gpu/bundle.sh) the way
ctest would on the build machine: same command, environment, working directory and skip code, the
build and source paths of that machine replaced by the bundle's and this checkout's.

  run_tests.py BUNDLE_DIR SOURCE_DIR [--group G ...] [--jobs N] [--timeout S] [--deadline S]
               [--log FILE] [--fail-on-skip] [--library-path PATH]

Prints one line per test (PASS / FAIL / SKIP / TIMEOUT / NOT RUN) and a summary
`tests: <group> passed=.. failed=.. skipped=.. not_run=..`; the log gets the output of every test
that did not pass. A gtest program that exits 0 but reports "[  SKIPPED ]" counts as skipped: on
a GPU machine a skip means the device was not found, which must not read as a pass. Exit status 1
if any test failed, timed out or was not run before the deadline (or, with --fail-on-skip, was
skipped).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _env_for(entry, build: str, source: str, library_path: str):
    env = dict(os.environ)
    if library_path:
        env["LD_LIBRARY_PATH"] = library_path
    sub = lambda v: v.replace("@BUILD@", build).replace("@SOURCE@", source)  # noqa: E731
    for key, value in entry["env"].items():
        env[key] = sub(value)
    for item in entry.get("env_modification") or []:
        key, _, rest = item.partition("=")
        op, _, value = rest.partition(":")
        value = sub(value)
        if op == "set":
            env[key] = value
        elif op == "unset":
            env.pop(key, None)
        elif op in ("string_append", "path_list_append"):
            sep = ":" if op == "path_list_append" and env.get(key) else ""
            env[key] = env.get(key, "") + sep + value
        elif op in ("string_prepend", "path_list_prepend"):
            sep = ":" if op == "path_list_prepend" and env.get(key) else ""
            env[key] = value + sep + env.get(key, "")
        elif op == "reset":
            env.pop(key, None)
            if key in os.environ:
                env[key] = os.environ[key]
    return env


def _run(entry, build: str, source: str, library_path: str, timeout: float, deadline: float):
    sub = lambda v: v.replace("@BUILD@", build).replace("@SOURCE@", source)  # noqa: E731
    if time.monotonic() >= deadline:
        return entry, "NOT RUN", 0.0, "deadline reached before this test started\n"
    limit = min(timeout, max(1.0, deadline - time.monotonic()))
    command = [sub(a) for a in entry["command"]]
    cwd = sub(entry.get("working_directory") or build)
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=cwd, env=_env_for(entry, build, source, library_path),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=limit)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        return entry, "TIMEOUT", time.monotonic() - start, out
    except OSError as e:
        return entry, "FAIL", time.monotonic() - start, f"cannot start: {e}\n"
    seconds = time.monotonic() - start
    out = done.stdout.decode(errors="replace")
    skip_code = entry.get("skip_return_code")
    if skip_code is not None and done.returncode == int(skip_code):
        return entry, "SKIP", seconds, out
    if done.returncode != 0:
        return entry, "FAIL", seconds, out + f"\n(exit status {done.returncode})\n"
    if "[  SKIPPED ]" in out:
        return entry, "SKIP", seconds, out
    return entry, "PASS", seconds, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("source")
    parser.add_argument("--group", action="append", help="only these groups (repeatable)")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120, help="per test, seconds")
    parser.add_argument("--deadline", type=float, default=1e9, help="whole run, seconds")
    parser.add_argument("--log", help="output of every test that did not pass")
    parser.add_argument("--library-path", default="",
                        help="LD_LIBRARY_PATH of the tests (default: the bundle's lib/)")
    parser.add_argument("--fail-on-skip", action="store_true",
                        help="a skipped test fails the run (on a GPU machine: no device found)")
    args = parser.parse_args()

    bundle = Path(args.bundle).resolve()
    build, source = str(bundle / "build"), str(Path(args.source).resolve())
    manifest = json.loads((bundle / "manifest.json").read_text())
    entries = [e for e in manifest["tests"] if not args.group or e["group"] in args.group]
    deadline = time.monotonic() + args.deadline
    counts = {}
    log = open(args.log, "a") if args.log else None
    library_path = args.library_path or str(bundle / "lib")

    def results():
        # Tests marked serial (bundle_tool.SERIAL) run alone, after the others.
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(_run, e, build, source, library_path, args.timeout, deadline)
                       for e in entries if not e.get("serial")]
            for future in concurrent.futures.as_completed(futures):
                yield future.result()
        for e in entries:
            if e.get("serial"):
                yield _run(e, build, source, library_path, args.timeout, deadline)

    for entry, result, seconds, out in results():
        group = counts.setdefault(entry["group"], {"PASS": 0, "FAIL": 0, "SKIP": 0,
                                                   "TIMEOUT": 0, "NOT RUN": 0})
        group[result] += 1
        print(f"{result:7} {seconds:7.2f}s  {entry['name']}", flush=True)
        if log and result != "PASS":
            log.write(f"===== {result} {entry['name']}\n{out}\n")
    if log:
        log.close()
    bad = 0
    for name, c in sorted(counts.items()):
        print(f"tests: {name} passed={c['PASS']} failed={c['FAIL'] + c['TIMEOUT']} "
              f"skipped={c['SKIP']} not_run={c['NOT RUN']}")
        bad += c["FAIL"] + c["TIMEOUT"] + c["NOT RUN"] + (c["SKIP"] if args.fail_on_skip else 0)
    if not entries:
        print("tests: none selected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
