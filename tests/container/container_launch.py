"""Start a built image's declared ENTRYPOINT + CMD as a server, and undo everything after.

Two ways, one interface (:class:`Launched`):

- ``podman run`` where it works (an ordinary workstation): the server's port published on
  127.0.0.1, the run dir mounted read-only at the CMD's ``--run-dir``, the HEALTHCHECK run by
  ``podman healthcheck run``.
- Otherwise, as root, the image's own filesystem (``podman create`` + ``podman mount``): /dev
  bound and /proc mounted into it, the run dir bound read-only at the CMD's ``--run-dir``, and
  the command started by ``unshare --root --wd --setuid --setgid``, that is with the image's
  root, working directory, user and group, and with exactly its ENV (plus HOME from its passwd,
  as podman adds). There is no network namespace, so JAXLAB_SERVE__HOST and __PORT are set
  (as ``-e`` would) to the host's loopback and a free port: the image's 0.0.0.0 would open the
  test server to the network. On the machines this project's CI runs on, ``podman run``
  fails: crun may not set the rlimits podman asks for, and with lower ones it refuses their
  hybrid cgroup v1/v2 setup.

Everything mounted, created or started is undone, in reverse order, when the context exits.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
from container_image import ImageSpec, run_dir_argument

Mode = Literal["podman-run", "chroot"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_mode(podman: str, spec: ImageSpec) -> Mode | None:
    """``podman-run`` where a container starts; else ``chroot`` as root; else None."""
    probe = subprocess.run(
        [podman, "run", "--rm", "--entrypoint", "python", spec.image_id, "-c", "pass"],
        capture_output=True,
        timeout=300,
    )
    if probe.returncode == 0:
        return "podman-run"
    return "chroot" if os.geteuid() == 0 else None


class Launched(abc.ABC):
    """A server started from the image; commands run in its filesystem as its user."""

    url: str
    server_pid: int  # the server's pid as the container's /proc shows it

    @abc.abstractmethod
    def exec(self, argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` beside the server: its filesystem, environment and user."""

    @abc.abstractmethod
    def healthcheck(self) -> int:
        """Run the image's HEALTHCHECK once; its exit status."""

    @abc.abstractmethod
    def running(self) -> bool: ...

    @abc.abstractmethod
    def stop(self, timeout_s: float) -> int:
        """SIGTERM, as ``podman stop`` sends; the exit status (killed after ``timeout_s``)."""

    @abc.abstractmethod
    def output(self) -> str:
        """The server's stdout and stderr so far."""

    def wait_until_ready(self, timeout_s: float) -> None:
        t_end = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            assert self.running(), f"the server exited:\n{self.output()[-3000:]}"
            assert time.monotonic() < t_end, f"not ready in {timeout_s} s:\n{self.output()[-3000:]}"
            time.sleep(0.2)


@contextlib.contextmanager
def launch(
    mode: Mode,
    podman: str,
    spec: ImageSpec,
    run_dir: Path,
    env: dict[str, str],
    workdir: Path,
) -> Iterator[Launched]:
    """The image serving ``run_dir``, with ``env`` added to its ENV (as ``-e`` adds)."""
    with contextlib.ExitStack() as stack:
        if mode == "podman-run":
            yield _PodmanRun.start(stack, podman, spec, run_dir, env)
        else:
            yield _Chroot.start(stack, podman, spec, run_dir, env, workdir)


# ------------------------------------------------------------------ podman run


class _PodmanRun(Launched):
    def __init__(self, podman: str, name: str, url: str) -> None:
        self.podman, self.name, self.url, self.server_pid = podman, name, url, 1

    @classmethod
    def start(
        cls,
        stack: contextlib.ExitStack,
        podman: str,
        spec: ImageSpec,
        run_dir: Path,
        env: dict[str, str],
    ) -> _PodmanRun:
        name = f"jaxlab-test-{uuid.uuid4().hex[:12]}"
        port = free_port()
        container_port = spec.env.get("JAXLAB_SERVE__PORT", "8000")
        argv = [podman, "run", "--detach", "--name", name]
        argv += ["--publish", f"127.0.0.1:{port}:{container_port}"]
        argv += ["--volume", f"{run_dir}:{run_dir_argument(spec.argv)}:ro,Z"]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        r = subprocess.run([*argv, spec.image_id], capture_output=True, text=True, timeout=300)
        stack.callback(subprocess.run, [podman, "rm", "--force", name], capture_output=True)
        assert r.returncode == 0, r.stderr
        return cls(podman, name, f"http://127.0.0.1:{port}")

    def exec(self, argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.podman, "exec", self.name, *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def healthcheck(self) -> int:
        return subprocess.run(
            [self.podman, "healthcheck", "run", self.name], capture_output=True
        ).returncode

    def _state(self, field: str) -> str:
        return subprocess.run(
            [self.podman, "inspect", "--format", f"{{{{.State.{field}}}}}", self.name],
            capture_output=True,
            text=True,
        ).stdout.strip()

    def running(self) -> bool:
        return self._state("Running") == "true"

    def stop(self, timeout_s: float) -> int:
        subprocess.run(
            [self.podman, "stop", "--time", str(int(timeout_s)), self.name],
            capture_output=True,
            timeout=timeout_s + 60,
        )
        return int(self._state("ExitCode"))

    def output(self) -> str:
        r = subprocess.run(
            [self.podman, "logs", self.name], capture_output=True, text=True, timeout=60
        )
        return r.stdout + r.stderr


# ------------------------------------------------------------------ the image's filesystem


class _Chroot(Launched):
    def __init__(
        self, root: Path, spec: ImageSpec, env: dict[str, str], user: tuple[int, int], log: Path
    ) -> None:
        self.root, self.spec, self.env, self.user, self.log = root, spec, env, user, log
        self.url = f"http://127.0.0.1:{env['JAXLAB_SERVE__PORT']}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.server_pid = 0

    @classmethod
    def start(
        cls,
        stack: contextlib.ExitStack,
        podman: str,
        spec: ImageSpec,
        run_dir: Path,
        env: dict[str, str],
        workdir: Path,
    ) -> _Chroot:
        cid = _out(podman, "create", spec.image_id)
        stack.callback(subprocess.run, [podman, "rm", "--force", cid], capture_output=True)
        root = Path(_out(podman, "mount", cid))
        stack.callback(_out, podman, "unmount", cid)

        _mount(stack, inside(root, "/dev"), "--bind", "/dev")
        _out("mount", "--make-private", str(inside(root, "/dev")))
        _mount(stack, inside(root, "/proc"), "-t", "proc", "proc")
        target = inside(root, run_dir_argument(spec.argv))
        target.mkdir(parents=True, exist_ok=True)
        _mount(stack, target, "--bind", str(run_dir))
        _out("mount", "-o", "remount,bind,ro", str(target))

        uid, gid, home = image_user(root, spec.user)
        port = free_port()
        full_env = {"HOME": home, **spec.env, **env}
        full_env |= {"JAXLAB_SERVE__HOST": "127.0.0.1", "JAXLAB_SERVE__PORT": str(port)}
        server = cls(root, spec, full_env, (uid, gid), workdir / "server.log")
        with server.log.open("wb") as log:
            server.proc = subprocess.Popen(
                server._in_image(spec.argv), env=full_env, stdout=log, stderr=subprocess.STDOUT
            )
        server.server_pid = server.proc.pid  # unshare execs it: same process
        stack.callback(server._kill)
        return server

    def _in_image(self, argv: list[str]) -> list[str]:
        unshare = shutil.which("unshare")
        assert unshare, "unshare (util-linux) is needed to run the image's filesystem"
        uid, gid = self.user
        return [
            unshare,
            f"--root={self.root}",
            f"--wd={self.spec.workdir}",
            "--setuid",
            str(uid),
            "--setgid",
            str(gid),
            "--",
            *argv,
        ]

    def exec(self, argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._in_image(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s
        )

    def healthcheck(self) -> int:
        test = self.spec.healthcheck
        if test[:1] == ["CMD"]:
            argv = test[1:]
        elif test[:1] == ["CMD-SHELL"]:
            argv = ["/bin/sh", "-c", test[1]]
        else:
            raise AssertionError(f"the image declares no HEALTHCHECK command: {test}")
        try:
            return self.exec(argv, timeout_s=self.spec.healthcheck_timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 1  # a timed-out check is a failed one, as the engine counts it

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._kill()
        return self.proc.returncode

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def inside(root: Path, path: str) -> Path:
    """``path`` in the image's tree under ``root``; refused if any part of it is a symlink,
    which would lead a mount out of the tree onto the host."""
    here = root
    for part in Path(path).relative_to("/").parts:
        here = here / part
        assert not here.is_symlink(), f"{path} passes through a symlink in the image ({here})"
    return here


def image_user(root: Path, user: str) -> tuple[int, int, str]:
    """``uid, gid, home`` of the image's USER (a name or a uid, with ``:group`` or not),
    looked up in the image's own /etc/passwd and /etc/group, as the engine does."""
    name, _, group = user.partition(":")
    name = name or "0"
    passwd = [e for e in (x.split(":") for x in _lines(inside(root, "/etc/passwd"))) if len(e) >= 7]
    entry = next((e for e in passwd if (e[2] if name.isdigit() else e[0]) == name), None)
    if name.isdigit():
        uid = int(name)
    elif entry is not None:
        uid = int(entry[2])
    else:
        raise AssertionError(f"USER {user}: no such user in the image's /etc/passwd")
    if not group:
        gid = int(entry[3]) if entry is not None else 0
    elif group.isdigit():
        gid = int(group)
    else:
        groups = {
            e[0]: int(e[2]) for e in (x.split(":") for x in _lines(inside(root, "/etc/group")))
        }
        assert group in groups, f"USER {user}: no such group in the image's /etc/group"
        gid = groups[group]
    return uid, gid, entry[5] if entry is not None else "/"


def _lines(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x and not x.startswith("#")]


def _out(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr}"
    return r.stdout.strip()


def _mount(stack: contextlib.ExitStack, target: Path, *args: str) -> None:
    _out("mount", *args, str(target))
    stack.callback(_out, "umount", str(target))
