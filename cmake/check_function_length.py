#!/usr/bin/env python3
"""The function-length check (ctest function_length_check).

Every function in the folders named on the command line must fit on a screen: at most
--max-lines lines from its signature to its closing brace. A long function is where a concept
hides from the reader; split it into named steps. Functions are found by lizard (PyPI), which
parses C++ without compiling it, so code the build does not compile (the CUDA backend in a build
without CUDA) is checked too.

    check_function_length.py --root REPO --max-lines 100 cache
Exits 1 listing every function over the limit (file:line name length), 0 otherwise.
"""
import argparse
import pathlib
import sys

try:
    import lizard
except ImportError:  # the test extra of the Python client installs it
    print("check_function_length: the lizard package is not installed "
          "(pip install lizard, or deploy/python_env.sh)", file=sys.stderr)
    sys.exit(1)

SUFFIXES = {".cc", ".h", ".cu", ".cuh"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the repository root")
    parser.add_argument("--max-lines", type=int, default=100)
    parser.add_argument("folders", nargs="+", help="folders relative to the root")
    args = parser.parse_args()
    root = pathlib.Path(args.root)
    long_ones = []
    checked = 0
    for folder in args.folders:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            info = lizard.analyze_file(str(path))
            for fn in info.function_list:
                checked += 1
                if fn.length > args.max_lines:
                    long_ones.append((path.relative_to(root), fn.start_line, fn.name, fn.length))
    for rel, line, name, length in long_ones:
        print(f"{rel}:{line}: {name} is {length} lines (limit {args.max_lines}): split it into "
              "named steps")
    print(f"{checked} functions checked in {', '.join(args.folders)}; {len(long_ones)} over "
          f"{args.max_lines} lines")
    return 1 if long_ones else 0


if __name__ == "__main__":
    sys.exit(main())
