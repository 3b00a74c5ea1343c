#!/usr/bin/env python3
"""Pieces of the GPU bundle (deploy/gpu/bundle.sh) that are easier in Python than in bash.

  bundle_tool.py targets BUILD_DIR
      The build targets the device run needs, one per line: the servers and benchmarks, every
      test program registered again with the CUDA backend (ctest names ending in /cuda; found in
      BUILD_DIR/build.ninja, Ninja generator), every test program whose name contains "cuda", and
      the backend-selection test.
  bundle_tool.py stage BUILD_DIR SOURCE_DIR STAGE_DIR
      Copies those programs (present ones; a build without CUDA has fewer) into STAGE_DIR/build at
      their paths inside BUILD_DIR, writes STAGE_DIR/manifest.json (the selected ctest entries with
      the build and source paths of this machine replaced by @BUILD@ and @SOURCE@), copies the
      shared-library closure (ldd) into STAGE_DIR/lib and strips everything.
  bundle_tool.py verify STAGE_DIR
      With an environment of only LD_LIBRARY_PATH=STAGE_DIR/lib, every program and library in the
      bundle resolves each library it needs inside STAGE_DIR/lib, or it is one of the system C/C++
      runtime libraries, or one the device provides (the CUDA driver, cuBLAS). Exit 1 otherwise.
  bundle_tool.py server BINARY DEST_DIR
      The server alone, as the Python wheel carries it (deploy/server_wheel.sh): BINARY copied to
      DEST_DIR/kvsidecar, the same shared-library closure into DEST_DIR/lib, both stripped, and
      checked as `verify` checks a bundle (DEST_DIR/kvsidecar instead of STAGE_DIR/build).

The libraries left out are the system C/C++ runtime (present on any glibc Linux, and newer on the
device than here) and the CUDA libraries the device image brings with its driver and toolkit:
libcuda (the driver itself; the bundle links the CUDA runtime statically) and cuBLAS (over 500 MiB,
needed by cuda_bench only; check.sh finds the device's copy).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# System C/C++ runtime: never bundled.
SYSTEM_LIBS = re.compile(
    r"^(linux-vdso|linux-gate|ld-linux(-x86-64)?|libc|libm|libpthread|libdl|librt|libstdc\+\+|"
    r"libgcc_s|libutil|libresolv|libmvec)\.so")
# Provided on the device (the driver, the CUDA toolkit / the image's torch wheels): never bundled.
DEVICE_LIBS = re.compile(r"^(libcuda|libcublas|libcublasLt|libnvidia-[a-z-]+)\.so")

# Programs every bundle carries when the build has them (paths inside the build directory).
PROGRAMS = {
    "kvsidecar": "service/kvsidecar",
    "kvs_demo": "clients/cpp/kvs_demo",
    "cuda_bench": "bench/cuda_bench",
    "service_bench": "bench/service_bench",
    "storage_bench": "bench/storage_bench",
    "rpc_counts": "bench/rpc_counts",
}
# Test programs selected besides the /cuda runs: --backend=auto and cuda selection.
EXTRA_TESTS = ("e2e_backend_test",)
# Tests of the selected programs that the device run leaves out, and why.
NOT_ON_DEVICE = {
    "CudaIpcWorkerChild.MapsAndWritesUntilKilled":
        "the child process of CudaIpcE2eTest.KilledWriterLeavesNoGpuMemoryBehind, not a test alone",
    "BackendE2eTest.CudaExits2WithTheReason": "runs only where no CUDA device is usable",
}
# Tests the device run starts alone, after the others, and why.
SERIAL = {
    "CudaIpcE2eTest.KilledWriterLeavesNoGpuMemoryBehind":
        "measures the device's free memory, which tests running beside it change",
}


def _ninja_executables(build: Path):
    """(path inside build, has /cuda runs) for every executable linked by build.ninja."""
    ninja = build / "build.ninja"
    if not ninja.is_file():
        raise SystemExit(f"bundle_tool: {ninja} not found (configure with -G Ninja)")
    found = {}
    current = None
    for line in ninja.read_text().splitlines():
        m = re.match(r"^build (\S+)(?: [^:|]*)?(?: \|[^:]*)?: CXX_EXECUTABLE_LINKER__", line)
        if m:
            current = m.group(1)
            found.setdefault(current, False)
        elif current and "TEST_SUFFIX=/cuda" in line:
            found[current] = True
        elif line.startswith("build "):
            current = None
    return found


def selected_tests(build: Path):
    """{path inside build: group} of the test programs the device run needs."""
    tests = {}
    for path, has_cuda_runs in _ninja_executables(build).items():
        if not path.startswith("tests/"):
            continue
        name = os.path.basename(path)
        if has_cuda_runs:
            tests[path] = "cuda_suite"
        elif "cuda_ipc" in name:
            tests[path] = "ipc"
        elif "cuda" in name:
            tests[path] = "parity"
        elif name in EXTRA_TESTS:
            tests[path] = "backend"
    return tests


def cmd_targets(build: Path) -> int:
    names = list(PROGRAMS) + [os.path.basename(p) for p in selected_tests(build)]
    known = {os.path.basename(p) for p in _ninja_executables(build)}
    for name in names:
        if name in known:
            print(name)
    return 0


def _ldd(path: Path, env=None):
    """[(soname, resolved path or None)] of `ldd path`."""
    out = subprocess.run(["/usr/bin/ldd", str(path)], capture_output=True, text=True, env=env)
    libs = []
    for line in out.stdout.splitlines():
        line = line.strip()
        m = re.match(r"^(\S+) => (not found|(\S+) \(0x[0-9a-f]+\))", line)
        if m:
            libs.append((m.group(1), None if m.group(2) == "not found" else m.group(3)))
            continue
        m = re.match(r"^(/\S+) \(0x[0-9a-f]+\)$", line)  # the loader itself
        if m:
            libs.append((os.path.basename(m.group(1)), m.group(1)))
    return libs


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _strip(path: Path) -> None:
    # --strip-unneeded keeps the dynamic symbols libraries and the loader need.
    subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)


def _replace_paths(value: str, build: Path, source: Path) -> str:
    # Build directory first: it usually lies inside the source directory.
    value = value.replace(str(build), "@BUILD@")
    return value.replace(str(source), "@SOURCE@")


def copy_closure(programs, lib: Path):
    """Copies the shared-library closure of `programs` (ldd lists it transitively) into `lib`,
    by the name the loader asks for, leaving out the system C/C++ runtime and the device's
    libraries; returns the sonames copied."""
    libs, missing = {}, set()
    for program in programs:
        for soname, resolved in _ldd(program):
            if SYSTEM_LIBS.match(soname) or DEVICE_LIBS.match(soname):
                continue
            if resolved is None:
                missing.add(f"{soname} (needed by {program.name})")
            else:
                libs[soname] = resolved
    if missing:
        raise SystemExit("bundle_tool: unresolved libraries here: " + ", ".join(sorted(missing)))
    lib.mkdir(parents=True, exist_ok=True)
    for soname, resolved in sorted(libs.items()):
        shutil.copy2(os.path.realpath(resolved), lib / soname)
    return sorted(libs)


def cmd_server(binary: Path, dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "kvsidecar"
    shutil.copy2(binary, target)
    libs = copy_closure([binary], dest / "lib")
    for path in [target] + list((dest / "lib").iterdir()):
        os.chmod(path, 0o755)
        _strip(path)
    print(f"bundle_tool: kvsidecar and {len(libs)} libraries in {dest}")
    return check_resolved(dest, [target])


def cmd_stage(build: Path, source: Path, stage: Path) -> int:
    build, source = build.resolve(), source.resolve()
    (stage / "build").mkdir(parents=True, exist_ok=True)
    (stage / "lib").mkdir(exist_ok=True)
    tests = selected_tests(build)
    programs = []
    for rel in list(PROGRAMS.values()) + sorted(tests):
        if (build / rel).is_file():
            programs.append(rel)
        elif rel in (PROGRAMS["kvsidecar"], PROGRAMS["kvs_demo"]):
            raise SystemExit(f"bundle_tool: {build / rel} is not built")
        else:
            print(f"bundle_tool: not in this build, left out: {rel}", file=sys.stderr)

    # The ctest entries of the selected programs (gtest_discover_tests writes them at build time).
    shown = subprocess.run(["ctest", "--test-dir", str(build), "--show-only=json-v1"],
                           capture_output=True, text=True, check=True)
    entries = []
    for test in json.loads(shown.stdout).get("tests", []):
        command = test.get("command") or []
        if not command:
            continue
        exe = Path(command[0]).resolve()
        try:
            rel = str(exe.relative_to(build))
        except ValueError:
            continue
        group = tests.get(rel)
        if group is None or rel not in programs:
            continue
        if group == "cuda_suite" and not test["name"].endswith("/cuda"):
            continue  # the plain and /device_sim runs of these programs ran here already
        if test["name"] in NOT_ON_DEVICE:
            continue
        props = {p["name"]: p["value"] for p in test.get("properties", [])}
        env = {}
        for item in props.get("ENVIRONMENT", []):
            key, _, value = item.partition("=")
            env[key] = _replace_paths(value, build, source)
        entries.append({
            "name": test["name"],
            "group": group,
            "command": ["@BUILD@/" + rel] + [_replace_paths(a, build, source) for a in command[1:]],
            "env": env,
            "env_modification": [_replace_paths(m, build, source)
                                 for m in props.get("ENVIRONMENT_MODIFICATION", [])],
            "working_directory": _replace_paths(props.get("WORKING_DIRECTORY", str(build)),
                                                build, source),
            "serial": test["name"] in SERIAL,
            "skip_return_code": props.get("SKIP_RETURN_CODE"),
            "timeout": props.get("TIMEOUT"),
        })

    for rel in programs:
        target = stage / "build" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / rel, target)

    libs = copy_closure([build / rel for rel in programs], stage / "lib")
    for path in list((stage / "build").rglob("*")) + list((stage / "lib").iterdir()):
        if path.is_file() and _is_elf(path):
            os.chmod(path, 0o755)
            _strip(path)

    git = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    cache = {}
    for line in (build / "CMakeCache.txt").read_text().splitlines():
        m = re.match(r"^(CMAKE_BUILD_TYPE|KVS_WITH_CUDA|CMAKE_CUDA_ARCHITECTURES):[A-Z]+=(.*)$",
                     line)
        if m:
            cache[m.group(1)] = m.group(2)
    manifest = {
        "commit": git.stdout.strip() + ("-dirty" if dirty else ""),
        "build": cache,
        "programs": programs,
        "libs": sorted(libs),
        "left_out": {"system": SYSTEM_LIBS.pattern, "device": DEVICE_LIBS.pattern},
        "tests": entries,
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    groups = {}
    for e in entries:
        groups[e["group"]] = groups.get(e["group"], 0) + 1
    print(f"bundle_tool: {len(programs)} programs, {len(libs)} libraries, "
          f"{len(entries)} tests {groups}")
    return 0


def cmd_verify(stage: Path) -> int:
    stage = stage.resolve()
    return check_resolved(stage, sorted((stage / "build").rglob("*")))


def check_resolved(stage: Path, programs) -> int:
    """Every ELF file of `programs` and of stage/lib resolves its libraries in stage/lib (or is
    the system's or the device's): 0, else 1, each problem printed."""
    stage = stage.resolve()
    lib = stage / "lib"
    env = {"LD_LIBRARY_PATH": str(lib)}
    problems, device_needed = [], set()
    files = [p for p in list(programs) + sorted(lib.iterdir()) if p.is_file() and _is_elf(p)]
    for path in files:
        for soname, resolved in _ldd(path, env=env):
            if SYSTEM_LIBS.match(soname):
                continue
            if DEVICE_LIBS.match(soname):
                device_needed.add(soname)
                continue
            if resolved is None:
                problems.append(f"{path.relative_to(stage)}: {soname} not found")
            elif not Path(resolved).resolve().is_relative_to(lib):
                problems.append(f"{path.relative_to(stage)}: {soname} resolved outside the "
                                f"bundle, at {resolved}")
    for p in problems:
        print("verify: " + p, file=sys.stderr)
    note = f"; needs from the device: {', '.join(sorted(device_needed))}" if device_needed else ""
    print(f"verify: {len(files)} ELF files, {len(problems)} problems{note}")
    return 1 if problems else 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "targets":
        return cmd_targets(Path(argv[2]))
    if len(argv) >= 5 and argv[1] == "stage":
        return cmd_stage(Path(argv[2]), Path(argv[3]), Path(argv[4]))
    if len(argv) >= 3 and argv[1] == "verify":
        return cmd_verify(Path(argv[2]))
    if len(argv) >= 4 and argv[1] == "server":
        return cmd_server(Path(argv[2]), Path(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
