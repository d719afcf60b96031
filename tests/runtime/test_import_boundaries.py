"""What the serving side may import: the runtime never imports the compiler or transformers, and neither the runtime
nor `ft serve` / `ft kernels build` needs `cryptography` (only signing and checking bundles do; GPU machines are often
set up without it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_the_runtime_imports_neither_the_compiler_nor_transformers_nor_cryptography():
    res = _run("""
        import sys
        sys.modules["cryptography"] = None  # importing it now raises ImportError
        import ft.runtime.engine, ft.runtime.gpu.prebuilt, ft.runtime.server.app, ft.runtime.plan.select
        bad = sorted(m for m in sys.modules if m.startswith(("ft.compiler", "transformers")))
        print("BAD", bad)
    """)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "BAD []" in res.stdout


def test_the_cli_serves_and_builds_kernels_without_cryptography():
    res = _run("""
        import sys
        sys.modules["cryptography"] = None
        from ft.cli.main import main
        for cmd in (["serve", "--help"], ["kernels", "build", "--help"], ["plan", "--help"]):
            sys.argv = ["ft", *cmd]
            try:
                main()
            except SystemExit as e:
                assert e.code in (0, None), (cmd, e.code)
        print("OK")
    """)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
