#!/usr/bin/env python3
"""Build the container images docker-compose.yml runs, without any image registry.

    python deploy/images.py [all|base|cassandra|cassmail|compose] [--engine podman|docker]

Operators who can pull images need none of this: docker-compose.yml names the official
``cassandra:5.0`` image and builds ``cassmail:latest`` from deploy/Dockerfile on the
official ``debian:bookworm-slim``. Where no registry is reachable, this script makes:

``base``       a Debian bookworm image from ``debootstrap --variant=minbase`` (Debian's own
               package mirror is all it needs), imported as ``localhost/cassmail-base:bookworm``;
``cassandra``  Apache Cassandra 5.0 on Debian's Java 17, from the jars the launcher fetches
               from Maven Central into ``~/.cache/cassmail`` (reused when present), tagged
               ``cassandra:5.0`` so that the compose file's ``image:`` lines resolve to it;
``cassmail``   deploy/Dockerfile on that base, tagged ``cassmail:latest``;
``compose``    (not part of ``all``) Docker Compose v2, the docker CLI's plugin, from Debian's
               ``docker-compose`` package of trixie where the docker CLI has none.

Re-runs are fast: the base is made once (``--rebuild-base`` makes it again), and the other
two are ordinary builds whose layers the engine caches. Standard library only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASE_IMAGE = "localhost/cassmail-base:bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("CASSMAIL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: The names compose resolves: a Docker engine calls `cassandra:5.0` docker.io/library/cassandra:5.0.
CASSANDRA_TAGS = ("docker.io/library/cassandra:5.0", "localhost/cassmail-cassandra:5.0")
CASSMAIL_TAGS = ("localhost/cassmail:latest", "docker.io/library/cassmail:latest")
#: Docker Compose v2 comes from Debian's docker-compose package of this suite (bookworm's is v1).
COMPOSE_SUITE = os.environ.get("CASSMAIL_COMPOSE_SUITE", "trixie")
COMPOSE_PLUGIN = "usr/libexec/docker/cli-plugins/docker-compose"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
#: What a sandboxed build step may ask of the kernel (podman's defaults exceed some sandboxes).
BUILD_ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1000:1000")
#: Podman writes OCI images by default, which have no HEALTHCHECK; the Docker format keeps it.
PODMAN_FORMAT = ("--format", "docker")


class ImageError(Exception):
    """A step that cannot be done, in one line for the person running the script."""


def _load_launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cassmail_launcher", HERE / "cassandra" / "launcher.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_engine(wanted: str | None = None) -> list[str]:
    """The container engine's command: podman, else a docker whose daemon answers.

    Podman runs with runc where it is installed: crun refuses the hybrid cgroup layout
    (v1 controllers beside an empty v2 tree) that some sandboxes and older hosts have.

    Raises ImageError with one line naming what is missing, so that a machine without
    any engine fails at once with a clear message instead of a compose traceback.
    """
    wanted = wanted or os.environ.get("CASSMAIL_ENGINE") or None
    candidates = [wanted] if wanted else ["podman", "docker"]
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        if name == "docker" or Path(path).name == "docker":
            probe = subprocess.run([path, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True)
            if probe.returncode != 0:
                continue
            return [path]
        return [path, *podman_runtime()]
    if wanted:
        raise ImageError(f"container engine {wanted!r} not found on PATH (or its daemon does not answer)")
    raise ImageError(
        "no container engine: install podman (apt-get install podman) or Docker with a running daemon"
    )


def podman_runtime() -> list[str]:
    """Podman's global option that picks the OCI runtime: runc when present (see find_engine)."""
    runtime = os.environ.get("CASSMAIL_PODMAN_RUNTIME") or ("runc" if shutil.which("runc") else "")
    return [f"--runtime={runtime}"] if runtime else []


def image_exists(engine: list[str], name: str) -> bool:
    return subprocess.run([*engine, "image", "inspect", name], capture_output=True).returncode == 0


def run(cmd: list[str], **kwargs: object) -> None:
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise ImageError(f"{Path(cmd[0]).name} {next(a for a in cmd[1:] if not a.startswith('-'))} failed (exit {proc.returncode})")


def build_base(engine: list[str], rebuild: bool = False) -> None:
    """debootstrap a minimal bookworm into a temporary folder and import it as BASE_IMAGE."""
    if image_exists(engine, BASE_IMAGE) and not rebuild:
        print(f"{BASE_IMAGE}: present")
        return
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise ImageError("debootstrap not found: apt-get install debootstrap (it builds the Debian base image)")
    if os.geteuid() != 0:
        raise ImageError("debootstrap needs root: run this as root (or pull debian:bookworm-slim instead)")
    with tempfile.TemporaryDirectory(prefix="cassmail-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run([debootstrap, "--variant=minbase", "--include=ca-certificates", DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR],
            stdout=subprocess.DEVNULL)
        # What the slim images leave out too: package lists and caches are refetched by apt-get update.
        for sub in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for entry in (rootfs / sub).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."], stdout=subprocess.PIPE)
        run([*engine, "import",
             "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--change", 'CMD ["/bin/bash"]',
             "-", BASE_IMAGE], stdin=tar.stdout, stdout=subprocess.DEVNULL)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0:
            raise ImageError("tar of the debootstrap folder failed")


def _format(engine: list[str]) -> tuple[str, ...]:
    return PODMAN_FORMAT if Path(engine[0]).name == "podman" else ()


def _tags(tags: tuple[str, ...]) -> list[str]:
    return [arg for tag in tags for arg in ("-t", tag)]


def build_cassandra(engine: list[str]) -> None:
    """The Cassandra image, from a build context of the launcher's cached jars and the entrypoint."""
    launcher = _load_launcher()
    try:
        lib = launcher.ensure_jars()
    except launcher.LauncherError as exc:
        raise ImageError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="cassmail-cassandra-context-") as tmp:
        context = Path(tmp)
        # Hard links when the cache is on the same file system: no 66 MB copy per build.
        shutil.copytree(lib, context / "lib", copy_function=_link_or_copy)
        for name in ("launcher.py", "entrypoint.py", "Dockerfile"):
            shutil.copy2(HERE / "cassandra" / name, context / name)
        run([*engine, "build", *_format(engine), *BUILD_ULIMITS, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
             *_tags(CASSANDRA_TAGS), str(context)])


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _pip_trust(engine: list[str]) -> list[str]:
    """The host's CA bundle for pip inside the build, where the host's pip is told to use one
    (PIP_CERT): PyPI behind a TLS-inspecting proxy. Podman mounts it for the build only."""
    bundle = os.environ.get("PIP_CERT") or ""
    if not bundle or not Path(bundle).is_file() or Path(engine[0]).name != "podman":
        return []
    inside = "/run/host-ca-bundle.crt"
    return ["-v", f"{bundle}:{inside}:ro", "--build-arg", f"HOST_CA_BUNDLE={inside}"]


def build_cassmail(engine: list[str]) -> None:
    run([*engine, "build", *_format(engine), *BUILD_ULIMITS, *_pip_trust(engine), "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
         "-f", str(HERE / "Dockerfile"), *_tags(CASSMAIL_TAGS), str(REPO)])


def build_compose() -> None:
    """Docker Compose v2 as the docker CLI's plugin, where the docker CLI has none.

    It is Debian's own ``docker-compose`` package of COMPOSE_SUITE (trixie packages v2, a
    static Go binary; bookworm's is v1). apt fetches it with a state folder of its own in the
    cache, verified against Debian's archive keys, so the host's sources and packages are
    not touched; the plugin is taken out of the package.
    """
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        print("docker compose: present")
        return
    apt, dpkg_deb = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or dpkg_deb is None:
        raise ImageError("apt-get not found: install Docker Compose v2 (Docker's docker-compose-plugin) or podman-compose")
    state = _launcher_cache() / "compose" / "apt"
    for sub in ("sources", "lists/partial", "cache/archives/partial"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / "sources" / "compose.sources").write_text(
        f"Types: deb\nURIs: {DEBIAN_MIRROR}\nSuites: {COMPOSE_SUITE}\nComponents: main\nSigned-By: {DEBIAN_KEYRING}\n"
    )
    options = [
        "-q", "-o", f"Dir::Etc::SourceList={state / 'none.list'}", "-o", f"Dir::Etc::SourceParts={state / 'sources'}",
        "-o", f"Dir::State::Lists={state / 'lists'}", "-o", f"Dir::Cache={state / 'cache'}",
        # The package is written into a folder of this user's: apt's own user could not write there.
        "-o", "APT::Sandbox::User=root" if os.geteuid() == 0 else "APT::Sandbox::User=",
    ]
    run([apt, *options, "update"], stdout=subprocess.DEVNULL)
    plugins = Path.home() / ".docker" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="compose-deb-") as tmp:
        run([apt, *options, "download", "docker-compose"], cwd=tmp, stdout=subprocess.DEVNULL)
        deb = next(Path(tmp).glob("docker-compose_*.deb"), None)
        if deb is None:
            raise ImageError(f"apt-get download docker-compose ({COMPOSE_SUITE}) left no package")
        run([dpkg_deb, "-x", str(deb), str(Path(tmp) / "root")])
        shutil.copy2(Path(tmp) / "root" / COMPOSE_PLUGIN, plugins / "docker-compose")
    version = subprocess.run([str(plugins / "docker-compose"), "version", "--short"], capture_output=True, text=True)
    if version.returncode != 0 or not version.stdout.strip().lstrip("v").startswith("2"):
        raise ImageError(f"{deb.name} is not Docker Compose v2: {(version.stdout + version.stderr).strip()[:200]}")
    print(f"docker compose: {plugins / 'docker-compose'} ({deb.name}, {version.stdout.strip()})")


def _launcher_cache() -> Path:
    return Path(_load_launcher().default_cache_dir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", default="all", choices=("all", "base", "cassandra", "cassmail", "compose"))
    parser.add_argument("--engine", help="podman or docker (default: podman if installed, else docker)")
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the base image again")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        if args.what == "compose":
            build_compose()
            return 0
        engine = find_engine(args.engine)
        build_base(engine, rebuild=args.rebuild_base)
        builds = [build for what, build in (("cassandra", build_cassandra), ("cassmail", build_cassmail))
                  if args.what in ("all", what)]
        # Side by side: each is mostly apt and pip fetching, so two take little longer than one.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(builds))) as pool:
            for done in [pool.submit(build, engine) for build in builds]:
                done.result()
    except ImageError as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    print(f"images: {args.what} ready in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
