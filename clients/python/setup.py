"""Build hook of the kvsidecar Python package: generates the gRPC stubs at build time.

The .proto files live outside the package, in <repo>/proto (../../proto from here). They are
compiled with grpcio-tools into kvsidecar/v1/*_pb2.py and *_pb2_grpc.py, which are never
committed: a regular build writes them into the build tree, an editable install (pip install -e)
writes them next to the sources (git-ignored). Set KVSIDECAR_PROTO_DIR to build from elsewhere.
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO_FILES = ("common.proto", "sidecar.proto", "admin.proto")


def _proto_root() -> Path:
    candidates = []
    if os.environ.get("KVSIDECAR_PROTO_DIR"):
        candidates.append(Path(os.environ["KVSIDECAR_PROTO_DIR"]))
    candidates += [HERE.parent.parent / "proto", HERE / "proto"]
    for root in candidates:
        if all((root / "kvsidecar" / "v1" / name).is_file() for name in PROTO_FILES):
            return root
    raise SystemExit(
        "kvsidecar: cannot find the .proto files (kvsidecar/v1/{%s}) under any of: %s. Build from a "
        "checkout of the kvsidecar repository (pip install ./clients/python) or set "
        "KVSIDECAR_PROTO_DIR to the directory that holds kvsidecar/v1/*.proto."
        % (",".join(PROTO_FILES), ", ".join(str(c) for c in candidates)))


def generate_stubs(out_dir: Path) -> None:
    """Compiles the protos into out_dir/kvsidecar/v1 (python, grpc and .pyi stubs)."""
    import grpc_tools
    from grpc_tools import protoc

    root = _proto_root()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    target = out_dir / "kvsidecar" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(root / "kvsidecar" / "v1" / name) for name in PROTO_FILES]
    if protoc.main(args) != 0:
        raise SystemExit("kvsidecar: grpc_tools.protoc failed on %s" % root)
    init = target / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC/protobuf stubs of kvsidecar.v1 (built from proto/)."""\n')


class BuildPyWithStubs(build_py):
    """build_py that also generates the stubs (into the sources for editable installs)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            generate_stubs(HERE)
        else:
            generate_stubs(Path(self.build_lib))


setup(cmdclass={"build_py": BuildPyWithStubs})
