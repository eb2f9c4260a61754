"""A process tree for launch tests: ``process_tree.py LEVEL DEPTH PID_FILE [--ignore-term]``.

Each level appends its pid to PID_FILE, prints a line, starts the next level and sleeps. Level 2 calls
setsid() (as torchrun does for its ranks) so it escapes the launcher's process group; with
--ignore-term the deepest level ignores SIGTERM and only SIGKILL stops it.
"""

import os
import signal
import subprocess
import sys
import time

level, depth, pid_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ignore_term = "--ignore-term" in sys.argv
if level == 2:
    os.setsid()
if level == depth and ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# the line first, in one write, then the pid: a reader that waits for the pids has every line already (a launcher
# printing after that cannot interleave with a level's line on the shared pipe)
os.write(1, f"level {level} pid {os.getpid()}\n".encode())
with open(pid_file, "a") as f:
    f.write(f"{os.getpid()}\n")
if level < depth:
    subprocess.Popen([sys.executable, __file__, str(level + 1), str(depth), pid_file, *sys.argv[4:]])
time.sleep(600)
