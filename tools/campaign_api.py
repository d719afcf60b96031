"""Campaign: schemathesis over `ft serve`'s own OpenAPI schema; the target is no 5xx answer.

    python tools/campaign_api.py --out DIR [--max-examples 150] [--port 19191]

Needs schemathesis (`pip install schemathesis`; not a project dependency). Synthesizes and compiles the `tiny`
qwen3_moe checkpoint, serves it on the CPU with an API key and a 64-token output cap, and runs `st run` against
/openapi.json (behind the key) with the `not_a_server_error` check, every phase (examples, coverage, fuzzing,
stateful), deterministic generation. Writes DIR/campaign_api.json (command, test cases generated and passed,
failures, the tail of the report) and exits with schemathesis's status.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FT = [sys.executable, "-c", "from ft.cli.main import main; main()"]


def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become ready in {timeout:.0f} s")
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-examples", type=int, default=150)
    ap.add_argument("--port", type=int, default=19191)
    args = ap.parse_args()
    st = shutil.which("st")
    if st is None:
        print("schemathesis is not installed: pip install schemathesis", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run(FT + ["synth", "--arch", "qwen3_moe", "--preset", "tiny", "--out", str(work / "hf")],
                       check=True, capture_output=True)
        subprocess.run(FT + ["checkpoint", "--model", str(work / "hf"), "--out", str(work / "m.ftw"),
                             "--no-progress"], check=True, capture_output=True)
        # --max-output-tokens 64: a request without max_tokens would otherwise generate up to 32k tokens on the CPU,
        # past schemathesis's 10 s read timeout (a slow answer, not an error)
        server = subprocess.Popen(FT + ["serve", "--ftw", str(work / "m.ftw"), "--port", str(args.port), "--device",
                                        "cpu", "--api-key", "k", "--log-level", "warning", "--max-output-tokens", "64"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(url)
            cmd = [st, "run", url + "/openapi.json", "-H", "Authorization: Bearer k", "--checks",
                   "not_a_server_error", "--max-examples", str(args.max_examples), "--generation-deterministic"]
            t = time.perf_counter()
            run = subprocess.run(cmd, capture_output=True, text=True)
            seconds = time.perf_counter() - t
            alive = server.poll() is None
        finally:
            server.terminate()
            server.wait(30)
    report = run.stdout + run.stderr
    cases = re.search(r"(\d+) generated, (\d+) passed", report)
    failures = re.search(r"(\d+) failed", report.split("Test cases:")[-1]) if "Test cases:" in report else None
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "schemathesis": " ".join(cmd[1:]), "seconds": round(seconds, 1), "exit": run.returncode,
              "server_alive_after": alive, "generated": int(cases.group(1)) if cases else None,
              "passed": int(cases.group(2)) if cases else None,
              "failed": int(failures.group(1)) if failures else 0, "report_tail": report[-3000:]}
    (args.out / "campaign_api.json").write_text(json.dumps(result, indent=1) + "\n")
    print(report[-1500:])
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
