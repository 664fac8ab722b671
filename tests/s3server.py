"""A real S3-protocol server on 127.0.0.1 for the tests (moto in server mode, its own process).

``S3Server.start()`` picks a free port, starts ``python -m moto.server``, waits until it
answers, and gives the environment every S3 client of the tests and benches runs with
(``env``, :func:`offline_env`); ``stop()`` ends it. If it cannot start, :class:`ServerError`
says why: the fixture turns that into a test failure, never a skip.

No packet leaves the loopback interface: ``env`` holds dummy credentials, a region and the
loopback endpoint, turns off the clients' cloud discovery (botocore's instance metadata,
``AWS_EC2_METADATA_DISABLED``; config and credentials files: ``os.devnull``; metadata
endpoints: a closed loopback port) and removes what would make a client look elsewhere
(profiles, web identity, container credentials, another S3 endpoint, proxies: ``UNSET``).
obstore (Rust object_store) takes no instance-metadata switch: it only looks for credentials
when none are given, and the explicit key pair in ``env`` is always given. ``env`` maps a
variable to None where it must be removed: apply it with :func:`tests.dist.apply_env` (the
``s3`` fixture, ``tests.dist`` ranks, bench/storage.py) or :meth:`S3Server.environ` (a
complete environment for a subprocess).
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
import urllib.request

from tests.dist import apply_env  # (a None in an env removes the variable)


def _die_with_parent() -> None:
    """In the server process: end when the process that started it ends (Linux), so a
    killed test run leaves no server behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass


class ServerError(RuntimeError):
    pass


#: nothing listens there: a client that asked a metadata service anyway fails at once, here
CLOSED = "http://127.0.0.1:1"

#: what would make an AWS client find credentials, settings or a route other than those in
#: :func:`offline_env`: removed wherever an S3 client runs in the tests and benches
UNSET = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME", "AWS_STS_ENDPOINT",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_USE_FIPS_ENDPOINT",
    "AWS_USE_DUALSTACK_ENDPOINT", "AWS_S3_EXPRESS", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_SKIP_SIGNATURE",
    "AWS_IMDSV1_FALLBACK", "UNICKPT_STORAGE_OPTIONS",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
)
#: prefixes of more such variables (fsspec reads FSSPEC_S3_<ARG> as s3fs arguments)
UNSET_PREFIXES = ("FSSPEC_S3_", "FSSPEC_S3A_")
LOOPBACK_NAMES = "127.0.0.1,localhost,::1"


def offline_env(endpoint: str, environ=None) -> dict[str, str | None]:
    """The environment of every S3 client in the tests and benches, for a server at
    ``endpoint`` (on 127.0.0.1); None: remove the variable (see :func:`tests.dist.apply_env`).
    ``environ`` (default ``os.environ``): where to look for prefixed variables to remove."""
    environ = os.environ if environ is None else environ
    env: dict[str, str | None] = {k: None for k in UNSET}
    env.update({k: None for k in environ if k.startswith(UNSET_PREFIXES)})
    env.update({
        "AWS_ACCESS_KEY_ID": "testing",  # explicit credentials: no client looks for others
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",  # botocore / s3fs: never ask instance metadata
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": CLOSED,
        "AWS_METADATA_ENDPOINT": CLOSED,  # obstore's instance metadata, were it ever asked
        "AWS_CONFIG_FILE": os.devnull,  # no profile, no credential_process, no endpoint from a file
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": LOOPBACK_NAMES,
        "no_proxy": LOOPBACK_NAMES,
    })
    return env


def _urlopen(url: str, timeout: float):
    """``urlopen`` without proxies (the environment's would take loopback requests elsewhere)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.env: dict[str, str] = {}
        self.log = ""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "S3Server":
        try:
            import moto.server  # noqa: F401
        except ImportError as e:
            raise ServerError(f"moto[server] is not installed ({e}); `make test` installs it (test extra)") from None
        for _ in range(3):  # a port taken between choosing and binding: try another
            self.port = _free_port()
            self.env = offline_env(self.endpoint)
            self.log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"unickpt-moto-{self.port}.log")
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                              str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                             preexec_fn=_die_with_parent, env=self.environ())
            atexit.register(self.stop)
            deadline = time.monotonic() + timeout  # a hang guard: it answers within seconds
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    _urlopen(self.endpoint + "/moto-api/", timeout=2).read()
                    break
                except Exception:
                    time.sleep(0.2)
            if self.proc.poll() is None:
                break
        if self.proc is None or self.proc.poll() is not None:
            raise ServerError(f"the S3 test server (moto) did not start: see {self.log}:\n{self._tail()}")
        try:
            _urlopen(self.endpoint + "/moto-api/", timeout=5).read()
        except Exception as e:
            self.stop()
            raise ServerError(f"the S3 test server (moto) does not answer on {self.endpoint}: {e}\n{self._tail()}")
        return self

    def environ(self, extra: dict | None = None, base=None) -> dict[str, str]:
        """A complete environment for a subprocess that talks to this server: ``base``
        (default ``os.environ``) with :attr:`env` and then ``extra`` applied."""
        out = dict(os.environ if base is None else base)
        apply_env({**self.env, **offline_env(self.endpoint, out)}, out)  # (prefixed variables: those of ``base``)
        apply_env(dict(extra or {}), out)
        return out

    def _tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def client(self):
        """A boto3 S3 client for this server, built in :attr:`env` (no profile, file or
        metadata service consulted) with the credentials, region and endpoint given too."""
        import boto3

        before = apply_env(self.env)
        try:
            return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                aws_access_key_id="testing", aws_secret_access_key="testing")
        finally:
            apply_env(before)

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (idempotent); return ``s3://name``."""
        c = self.client()
        try:
            c.create_bucket(Bucket=name)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://{name}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.log:  # (read only to report a server that did not start)
            try:
                os.remove(self.log)
            except OSError:
                pass


class DroppingProxy:
    """A TCP proxy to ``127.0.0.1:upstream`` that drops every connection once it has carried
    more than ``limit`` bytes towards the server (a server that fails mid-upload)."""

    def __init__(self, upstream: int, limit: int) -> None:
        import threading

        self.upstream, self.limit = upstream, limit
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.dropped = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        import threading

        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            threading.Thread(target=self._pipe, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, upstream: bool) -> None:
        sent = 0
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                sent += len(data)
                if upstream and sent > self.limit:
                    self.dropped += 1
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


class LoopbackServer:
    """A TCP server on 127.0.0.1 (a port the kernel picks) that hands each connection to
    :meth:`handle` on a thread of its own, until :meth:`close`."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        import threading

        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(c,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        conn.close()

    def close(self) -> None:
        self.sock.close()


class ConnectionTrap(LoopbackServer):
    """A listener on 127.0.0.1 that answers nothing: it records each connection (with the
    first line the client sent, e.g. ``GET /latest/api/token``) and closes it. Point a
    discovery variable (a metadata, credentials, STS or proxy endpoint) at :attr:`url`, and a
    client that used it shows up in :attr:`hits` without any packet leaving the machine."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        super().__init__()

    def handle(self, c: socket.socket) -> None:
        try:
            c.settimeout(2)
            first = c.recv(1024).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError:
            first = ""
        self.hits.append(first)
        c.close()
