"""A process for tests/test_forkserver.py: prints one JSON line saying what it was started with,
then does what its arguments say (``exit [N]`` (default 3), ``raise``, ``sleep``, ``sleep-with-child``)."""

import json
import os
import subprocess
import sys
import time

child = None
if sys.argv[1] == "sleep-with-child":
    child = subprocess.Popen(["sleep", "600"])  # stays in our process group
print(
    json.dumps(
        {
            "pid": os.getpid(),
            "sid": os.getsid(0),
            "pgid": os.getpgid(0),
            "cwd": os.getcwd(),
            "probe": os.environ.get("FORKPROBE"),
            "argv": sys.argv[1:],
            # never imported by this module: present only when it was forked from the preloaded server
            "torch_loaded": "torch" in sys.modules,
            "child": child.pid if child else None,
        }
    ),
    flush=True,
)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
if sys.argv[1] == "raise":
    raise RuntimeError("the probe failed on purpose")
time.sleep(600)
