"""The static-libstdc++ trap: a shared object built by a compiler driver whose search path
has no libstdc++.so (the GPU image's default CXX) links libstdc++ statically,
and loading it next to torch's own libstdc++ crashes (AOTInductor packages segfaulted in
their first std::regex). charbuild checks every shared object it puts into an engine.

A shared object is refused when it defines libstdc++'s own runtime (the C++ personality
routine, __cxa_throw, std::terminate), or when it holds C++ code without listing
libstdc++.so.6 as a needed library. Pure C objects (Triton's launchers) pass."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

RUNTIME_SYMBOLS = ("__gxx_personality_v0", "__cxa_throw", "_ZSt9terminatev")


class StaticLibstdcxx(RuntimeError):
    pass


def _readelf(args: list[str], path: Path) -> str:
    exe = shutil.which("readelf")
    if exe is None:
        raise StaticLibstdcxx(f"{path}: readelf (binutils) is needed to check the shared "
                              "objects an engine carries; install binutils")
    return subprocess.run([exe, *args, str(path)], capture_output=True, text=True,
                          check=True).stdout


def problem(path: Path) -> str | None:
    """Why `path` carries a static libstdc++, or None if it does not."""
    needed = [ln.split("[", 1)[1].rstrip("]") for ln in _readelf(["-dW"], path).splitlines()
              if "(NEEDED)" in ln]
    defined, cxx = set(), False
    for ln in _readelf(["-sW"], path).splitlines():
        parts = ln.split()
        if len(parts) < 8 or not parts[0].rstrip(":").isdigit():
            continue
        name = parts[7].split("@")[0]
        cxx = cxx or name.startswith("_Z")
        if parts[6] != "UND":
            defined.add(name)
    has_libstdcxx = any(n.startswith("libstdc++.so") for n in needed)
    inside = sorted(defined.intersection(RUNTIME_SYMBOLS))
    if inside:
        return f"defines libstdc++'s {inside[0]} (libstdc++ linked statically)"
    if cxx and not has_libstdcxx:
        return "holds C++ code but does not list libstdc++.so.6 as needed"
    return None


def check_shared_objects(root: Path) -> list[str]:
    """Raise StaticLibstdcxx for the first bad shared object under root; return the
    checked ones (relative paths)."""
    checked = []
    for so in sorted(root.rglob("*.so")):
        why = problem(so)
        if why:
            raise StaticLibstdcxx(
                f"{so.relative_to(root)}: {why}; it would crash when loaded next to torch. "
                "Build with a C++ compiler that links libstdc++ dynamically (on the GPU "
                "machine: CXX=/usr/bin/g++)")
        checked.append(so.relative_to(root).as_posix())
    return checked
