"""Build hook of the kvsidecar Python package: generates the gRPC stubs at build time.

The .proto files live outside the package, in <repo>/proto (../../proto from here). They are
compiled with grpcio-tools into kvsidecar/v1/*_pb2.py and *_pb2_grpc.py, with typed stubs
(*_pb2.pyi, *_pb2_grpc.pyi) from mypy-protobuf so that `mypy --strict` checks calls through them.
They are never committed: a regular build writes them into the build tree, an editable install
(pip install -e) writes them next to the sources (git-ignored). Set KVSIDECAR_PROTO_DIR to build
from elsewhere.

Building leaves the source tree as it was: setuptools' build tree (build/) and metadata
(*.egg-info) go to a temporary directory of the build process, removed when it exits.
"""

import atexit
import os
import shutil
import sys
import tempfile
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


def _plugin(name: str) -> str:
    """Path of a protoc plugin script installed with the build requirements (mypy-protobuf)."""
    # pip puts the isolated build environment's scripts on PATH; a non-isolated build finds them
    # next to the interpreter.
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        raise SystemExit("kvsidecar: %s not found; the build requires mypy-protobuf "
                         "(pyproject.toml [build-system] requires)" % name)
    return found


def generate_stubs(out_dir: Path) -> None:
    """Compiles the protos into out_dir/kvsidecar/v1 (python, grpc and typed .pyi stubs)."""
    import grpc_tools
    from grpc_tools import protoc

    root = _proto_root()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    target = out_dir / "kvsidecar" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={out_dir}", f"--mypy_out={out_dir}",
            f"--grpc_python_out={out_dir}", f"--mypy_grpc_out={out_dir}"]
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


def _scratch_dir() -> str:
    """A directory outside the source tree for build/ and *.egg-info, removed at exit.

    Each PEP 517 hook runs in its own process, and each one gets its own directory; the hooks
    hand their results (the wheel, the metadata) to pip in directories pip names, not here.
    """
    scratch = tempfile.mkdtemp(prefix="kvsidecar-build-")
    atexit.register(shutil.rmtree, scratch, True)
    return scratch


def _platform_options() -> dict:
    """A package that carries the server (kvsidecar/_server, deploy/server_wheel.sh) holds native
    code: its wheel is tagged for this platform (py3-none-linux_x86_64), not py3-none-any."""
    if not (HERE / "kvsidecar" / "_server" / "kvsidecar").is_file():
        return {}
    import sysconfig
    return {"bdist_wheel": {"plat_name": sysconfig.get_platform().replace("-", "_")}}


_SCRATCH = _scratch_dir()
# Options given to setup() are defaults: the command line (pip's PEP 517 calls) still wins.
setup(cmdclass={"build_py": BuildPyWithStubs},
      options={"build": {"build_base": os.path.join(_SCRATCH, "build")},
               "egg_info": {"egg_base": _SCRATCH}, **_platform_options()})
