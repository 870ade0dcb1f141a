"""One process of ``jaxdp launch``, and everything it starts, ended with the launcher.

    python supervise.py LAUNCHER_PID FD -- COMMAND...

Why a process between the launcher and each command: the kernel's "die with your parent"
(``PR_SET_PDEATHSIG``) covers one generation. A command that is a wrapper (a shell script,
``uv run``, ``srun``) does its work in a grandchild, which a SIGKILL of the launcher (an OOM
killer, a scheduler) would leave running, reparented to PID 1. Something that outlives the
launcher has to end them: this supervisor, a few lines of the standard library.

- It dies-with-its-parent by SIGHUP, which it catches: the launcher is gone, so it kills the
  command's whole tree (below) and exits.
- It is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant whose parent exits is
  reparented to it, not to PID 1, so a double fork or a new session does not leave the tree:
  every descendant is found through ``/proc``'s parent links.
- The command runs in its own process group, whose id is its pid, written to ``FD`` (or
  ``error <reason>`` when it cannot start): the launcher signals that group (Ctrl-C, SIGTERM,
  SIGKILL) and names that pid, as it did when it started the command itself.
- When the command exits, whatever it left running is killed, and the supervisor exits as the
  command did (its exit code, or the same signal), which is what the launcher reports.

No jaxdp imports: it runs as a script (``python -I -S``), a few milliseconds of start-up.
"""

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SWEEP_S = 5.0  # the longest a kill of the tree keeps looking for stragglers


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop still works
        pass


def descendants(root: int) -> list:
    """Pids of the live (not zombie) processes below ``root``, from ``/proc``'s parent links."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except OSError:
            continue  # it just exited
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _reap() -> None:
    """Collect every child that has exited (orphans come to a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(group: int) -> None:
    """SIGKILL the command's process group and every process below this one, until none is left."""
    if group > 0:  # (0 would be this process's own group)
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + SWEEP_S
    while time.monotonic() < deadline:
        left = descendants(os.getpid())
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _reap()
        time.sleep(0.01)
    _reap()


def exit_like(status: int) -> None:
    """Leave as the command left: its exit code, or killed by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command's crash, not a core of this one
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL's action cannot be set, nor needs to be
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to die
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list) -> None:
    launcher, fd, command = int(argv[0]), int(argv[1]), argv[3:]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != launcher:  # it died before the line above: start nothing
        os._exit(1)
    child, early = None, []

    def on_signal(signum, _frame):
        if os.getppid() != launcher:  # the launcher is gone (its SIGHUP): nothing may outlive it
            kill_tree(child.pid if child else 0)
            os._exit(128 + signal.SIGHUP)
        if child is None:  # the launcher's Ctrl-C before the command started: passed on once it has
            early.append(signum)
            return
        try:
            os.killpg(child.pid, signum)  # meant for the command
        except ProcessLookupError:
            pass

    for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        child = subprocess.Popen(command, process_group=0, close_fds=True)
    except OSError as e:
        os.write(fd, f"error {e.strerror}".encode())
        os._exit(127)
    os.write(fd, f"pid {child.pid}".encode())
    os.close(fd)
    for signum in early:
        on_signal(signum, None)
    while True:
        pid, status = os.waitpid(-1, 0)  # the command, or an orphan reparented here
        if pid == child.pid:
            break
    child.returncode = status  # reaped here: Popen must not wait for it again
    kill_tree(child.pid)
    exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
