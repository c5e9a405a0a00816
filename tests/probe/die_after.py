"""Test helper: run the rest of argv as a child and SIGKILL it after N seconds, then exit 1.

It stands for an engine that dies in the middle of a probe (an OOM kill, a crash)."""

import subprocess
import sys
import time

seconds = float(sys.argv[1])
child = subprocess.Popen(sys.argv[2:])
deadline = time.monotonic() + seconds
while time.monotonic() < deadline and child.poll() is None:
    time.sleep(0.05)
if child.poll() is None:
    child.kill()
    child.wait()
print("die_after: engine killed", flush=True)
sys.exit(1)
