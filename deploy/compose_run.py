#!/usr/bin/env python3
"""Run `docker compose` on this machine's container engine: Docker, or podman through its Docker API.

    python deploy/compose_run.py [--nodes N] [--project NAME] COMPOSE-ARGS...
    python deploy/compose_run.py --nodes 1 up -d --wait
    python deploy/compose_run.py --nodes 1 down -v

With a Docker daemon this is plain ``docker compose`` on the project's compose file. With
podman (no Docker daemon), it starts ``podman system service`` on a private socket for the
duration of the command and points Docker Compose v2 at it (``python deploy/images.py
compose`` installs Compose v2 from Debian's docker-compose package when the docker CLI has
no compose plugin; ``podman-compose`` is used when neither is there). Podman runs healthchecks from
systemd timers; where there is no systemd, this process runs them itself every few seconds,
so ``depends_on: service_healthy`` and ``--wait`` work.

The compose file is ``deploy/compose.py --nodes N`` (docker-compose.yml itself for N = 3),
plus one override that only sets the ulimits the engine must ask for where its defaults
exceed the host's limits (see sandbox_override). Standard library only, apart from
compose.py's PyYAML.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import images  # noqa: E402  (beside this file)

#: Seconds between two rounds of healthchecks that this process runs for podman without systemd.
HEALTH_TICK = 3.0


class ComposeError(Exception):
    """What stops a compose run, in one line (no engine, no compose, a command that failed)."""


def sandbox_override(services: list[str]) -> dict[str, Any]:
    """ulimits for every service, within this host's hard limits.

    Podman asks the kernel for very high open-file and process limits by default, which a
    sandboxed host refuses (the container does not start); Docker takes its daemon's. This
    asks for at most 16384 open files and 8192 processes, or the host's hard limit if lower.
    """
    nofile = min(16384, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    nproc = min(8192, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    limits = {"nofile": {"soft": nofile, "hard": nofile}, "nproc": {"soft": nproc, "hard": nproc}}
    return {"services": {name: {"ulimits": limits} for name in services}}


def compose_file(nodes: int, directory: Path) -> list[Path]:
    """The compose file for `nodes` nodes and its override, written into `directory`."""
    import yaml  # compose.py needs it anyway

    sys.path.insert(0, str(HERE))
    import compose

    main = directory / "docker-compose.yml"
    main.write_text(compose.render(nodes))
    override = directory / "sandbox.override.json"  # JSON is YAML: compose reads it as is
    override.write_text(json.dumps(sandbox_override(list(yaml.safe_load(main.read_text())["services"]))))
    return [main, override]


class Engine:
    """A container engine that speaks the Docker API, and the compose command to drive it.

    For podman it owns a `podman system service` process and, without systemd, a thread
    running the project's healthchecks; `close` ends both (containers live on: they belong
    to podman, not to the service).
    """

    def __init__(self, project: str, files: list[Path], env: dict[str, str] | None = None) -> None:
        self.project = project
        self.files = files
        self.env = dict(os.environ if env is None else env)
        self._service: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.podman: list[str] | None = None
        self.compose_cmd: list[str] = []

    def __enter__(self) -> "Engine":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        try:
            engine = images.find_engine(self.env.get("CASSMAIL_ENGINE") or None)
        except images.ImageError as exc:
            raise ComposeError(str(exc)) from None
        if Path(engine[0]).name == "podman":
            self.podman = engine
            if not self.env.get("DOCKER_HOST"):
                self._start_service()
            if not Path("/run/systemd/private").exists():
                self._ticker = threading.Thread(target=self._tick, name="healthchecks", daemon=True)
                self._ticker.start()
        self.compose_cmd = self._find_compose()

    def _start_service(self) -> None:
        assert self.podman is not None
        self._tmp = tempfile.TemporaryDirectory(prefix="cassmail-podman-")
        sock = Path(self._tmp.name) / "podman.sock"
        self._service = subprocess.Popen(
            [*self.podman, "system", "service", "--time=0", f"unix://{sock}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not sock.exists():
            if self._service.poll() is not None or time.monotonic() > deadline:
                raise ComposeError("podman system service did not open its Docker API socket")
            time.sleep(0.1)
        self.env["DOCKER_HOST"] = f"unix://{sock}"

    def _find_compose(self) -> list[str]:
        docker = shutil.which("docker")
        if docker and subprocess.run([docker, "compose", "version"], capture_output=True, env=self.env).returncode == 0:
            return [docker, "compose"]
        for name in ("docker-compose", "podman-compose"):
            found = shutil.which(name)
            if found:
                return [found]
        raise ComposeError(
            "no compose command: build Docker Compose v2 with `python deploy/images.py compose` "
            "(or install podman-compose)"
        )

    def _tick(self) -> None:
        """What systemd's timers do for podman: run each running container's healthcheck."""
        assert self.podman is not None
        while not self._stop.wait(HEALTH_TICK):
            listed = subprocess.run(
                [*self.podman, "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}"],
                capture_output=True, text=True,
            )
            for cid in listed.stdout.split():
                if self._stop.is_set():
                    return
                subprocess.run([*self.podman, "healthcheck", "run", cid], capture_output=True)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=60)
        if self._service is not None:
            self._service.terminate()
            try:
                self._service.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._service.kill()
                self._service.wait()
            self._service = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def compose_args(self, *args: str) -> list[str]:
        files = [arg for path in self.files for arg in ("-f", str(path))]
        return [*self.compose_cmd, "-p", self.project, "--project-directory", str(REPO), *files, *args]

    def compose(self, *args: str, check: bool = True, capture: bool = False, input: str | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.compose_args(*args), env=self.env, text=True, input=input,
                              capture_output=capture, timeout=timeout)
        if check and proc.returncode != 0:
            detail = f": {(proc.stderr or '').strip().splitlines()[-1]}" if capture and proc.stderr else ""
            raise ComposeError(f"compose {' '.join(args)} failed (exit {proc.returncode}){detail}")
        return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="cluster size (default 3: docker-compose.yml)")
    parser.add_argument("--project", default="cassmail", help="compose project name (default cassmail)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="compose arguments, e.g. up -d --wait")
    ns = parser.parse_args(argv)
    if not ns.args:
        parser.error("give the compose command to run, e.g. up -d --wait")
    with tempfile.TemporaryDirectory(prefix="cassmail-compose-") as tmp:
        try:
            with Engine(ns.project, compose_file(ns.nodes, Path(tmp))) as engine:
                return engine.compose(*ns.args, check=False).returncode
        except ComposeError as exc:
            print(f"compose: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
