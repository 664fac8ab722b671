"""A real S3-protocol server on 127.0.0.1 for the tests (moto in server mode, its own process).

``S3Server.start()`` picks a free port, starts ``python -m moto.server``, waits until it
answers, and gives the standard AWS environment pointing at it (``env``); ``stop()`` ends
it. If it cannot start, :class:`ServerError` says why: the fixture turns that into a test
failure, never a skip.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
import urllib.request


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
            self.log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"unickpt-moto-{self.port}.log")
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                              str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                             preexec_fn=_die_with_parent)
            atexit.register(self.stop)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).read()
                    break
                except Exception:
                    time.sleep(0.2)
            if self.proc.poll() is None:
                break
        if self.proc is None or self.proc.poll() is not None:
            raise ServerError(f"the S3 test server (moto) did not start: see {self.log}:\n{self._tail()}")
        try:
            urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=5).read()
        except Exception as e:
            self.stop()
            raise ServerError(f"the S3 test server (moto) does not answer on {self.endpoint}: {e}\n{self._tail()}")
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        return self

    def _tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (idempotent); return ``s3://name``."""
        import boto3

        c = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                         aws_secret_access_key="testing")
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
