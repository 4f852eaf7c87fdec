"""The kernels' build: one format table shared by C and Python, signatures declared once, the
headers shipped in the wheel, and a word on stderr when ``auto`` runs without them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.wheel import install_wheel_elsewhere
from uag.kernels import choice, formats, native
from uag.kernels.formats import FORMATS, Format

needs_native = pytest.mark.skipif(
    native.native_unavailable() is not None, reason=f"native kernel: {native.native_unavailable()}"
)


def test_every_format_in_the_header_has_one_row_and_a_declared_kernel():
    """``formats.h``'s enum and ``FORMATS`` list the same formats, and each row's kernel is a
    function ``kernels.h`` declares (so its ctypes signature is set)."""
    codes = formats._codes(formats.CSRC / "formats.h")
    assert codes == {f.name: f.value for f in Format}
    assert len(set(codes.values())) == len(codes)
    assert set(FORMATS) == set(Format)
    declared = native.signatures()
    assert all(spec.kernel in declared for spec in FORMATS.values())


def test_signatures_read_every_prototype_and_refuse_what_they_cannot_bind(tmp_path):
    """Pointers bind as ``c_void_p``, values by their C type; a type the reader does not know
    is an error, not a default conversion."""
    import ctypes

    header = tmp_path / "k.h"
    header.write_text(
        "/* a comment; */\n#include <stdint.h>\nstruct s;\n"
        "int64_t uag_a(const float *x, int64_t n, float eps,\n    double *out);\n"
        "void uag_b(void);\n"
    )
    assert native.signatures(header) == {
        "uag_a": (
            ctypes.c_int64,
            [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p],
        ),
        "uag_b": (None, []),
    }
    header.write_text("void uag_c(size_t n);\n")
    with pytest.raises(ValueError, match="size_t"):
        native.signatures(header)


def test_auto_says_on_stderr_when_the_native_kernels_are_unavailable(monkeypatch, capsys):
    """``auto`` falls back, and says why on stderr, once; not when ``UAG_KERNELS`` chose."""
    monkeypatch.delenv("UAG_KERNELS", raising=False)
    monkeypatch.setattr(native, "native_unavailable", lambda: "no C compiler (a test)")
    cpu = torch.device("cpu")
    mode = choice.resolve_kernels("auto", cpu, torch.float32)
    assert mode in ("onednn", "plain")
    choice.resolve_kernels("auto", cpu, torch.float32)
    err = capsys.readouterr().err
    assert err.count("native kernels unavailable (no C compiler (a test))") == 1
    monkeypatch.setenv("UAG_KERNELS", "onednn")
    monkeypatch.setattr(native, "native_unavailable", lambda: "UAG_KERNELS=onednn")
    assert choice.resolve_kernels("auto", cpu, torch.float32) == mode
    assert capsys.readouterr().err == ""


@needs_native
def test_a_wheel_install_elsewhere_builds_and_runs_the_native_kernels(tmp_path):
    """The wheel, installed into another directory and imported from a third, compiles the
    kernels from its own ``csrc`` (headers included) and runs them: ``native_unavailable()`` is
    None, and a block int8 product equals the fp32 kernel's bits and agrees with torch."""
    site = install_wheel_elsewhere(tmp_path)
    probe = (
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "from uag.kernels import native\n"
        "from uag.kernels.formats import Format\n"
        "print(native.CSRC)\n"
        "print(native.native_unavailable())\n"
        "gen = torch.Generator().manual_seed(0)\n"
        "linear = nn.Linear(64, 24)\n"
        "q = torch.randint(-127, 128, (24, 64), generator=gen).float()\n"
        "q[:, ::32] = -127.0\n"
        "scales = torch.rand(24, 2, generator=gen).half().float().repeat_interleave(32, dim=1)\n"
        "with torch.no_grad():\n"
        "    linear.weight.copy_(q * scales)\n"
        "x = torch.randn(5, 64, generator=gen)\n"
        "blocked = native.NativeLinear(linear)\n"
        "plain = native.NativeLinear(linear, exact_blocks=False)\n"
        "y = blocked(x)\n"
        "print(blocked.format is Format.BLOCK_INT8, plain.format is Format.FP32)\n"
        "print(torch.equal(y, plain(x)), torch.allclose(y, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5))\n"
        "print(sorted(p.name[:7] for p in (native.cache_root() / 'kernels').glob('*.so')))\n"
    )
    env = {
        "PYTHONPATH": str(site),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "UAG_CACHE": str(tmp_path / "cache"),  # a fresh build, from the installed sources
    }
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    csrc, unavailable, formats_ok, products_ok, built = ran.stdout.splitlines()
    assert csrc.startswith(str(site))  # the installed copy's sources, not the checkout's
    assert unavailable == "None"
    assert formats_ok == "True True" and products_ok == "True True"
    assert built == "['skinny-']"


def test_the_kernels_build_wherever_they_can():
    """On an x86-64 CPU with AVX2 and a C compiler (CI's machines), the native kernels build
    and pass their self-test: a compile error or a failed self-test must fail the suite, not
    turn every native test into a skip."""
    import os
    import platform
    import shutil

    buildable = (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        and bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))
        and os.environ.get("UAG_KERNELS", "") not in ("onednn", "plain")
    )
    if not buildable:
        pytest.skip("no x86-64 AVX2 CPU with a C compiler here")
    assert native.native_unavailable() is None
