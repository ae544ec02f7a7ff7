"""The static-libstdc++ guard on real shared objects compiled here (skipped without g++)."""

import shutil
import subprocess

import pytest

from charengine.builder.so_check import StaticLibstdcxx, check_shared_objects, problem

CXX = """#include <regex>
#include <string>
extern "C" int f(const char* s) { return std::regex_match(std::string(s), std::regex("a+")); }
"""


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    if not (shutil.which("g++") and shutil.which("gcc") and shutil.which("readelf")):
        pytest.skip("needs g++, gcc and readelf")
    d = tmp_path_factory.mktemp("so")
    (d / "a.cpp").write_text(CXX)
    (d / "b.c").write_text("int g(int x) { return x + 1; }\n")
    for out, cmd in (("dynamic.so", ["g++", "a.cpp"]),
                     ("static.so", ["g++", "-static-libstdc++", "a.cpp"]),
                     ("plain_c.so", ["gcc", "b.c"])):
        subprocess.run([*cmd, "-shared", "-fPIC", "-o", out], cwd=d, check=True)
    return d


def test_a_statically_linked_libstdcxx_is_found(objects):
    assert problem(objects / "dynamic.so") is None
    assert problem(objects / "plain_c.so") is None  # Triton's launchers are C
    assert "libstdc++ linked statically" in problem(objects / "static.so")


def test_an_engine_with_one_is_refused_naming_the_file_and_the_fix(objects, tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    shutil.copy(objects / "plain_c.so", kernels / "launcher.so")
    assert check_shared_objects(kernels) == ["launcher.so"]
    shutil.copy(objects / "static.so", kernels / "model.so")
    with pytest.raises(StaticLibstdcxx, match=r"model.so: defines libstdc\+\+'s .* CXX=/usr/bin/g\+\+"):
        check_shared_objects(kernels)
