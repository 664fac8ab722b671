import os
import sys

# Rank processes import test modules by name: make the repository root importable.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3():
    """A real S3-protocol server (moto) on 127.0.0.1, a free port; the environment of
    tests.s3server.offline_env (dummy credentials, a region, its endpoint, no cloud
    discovery, no proxies: nothing leaves the loopback interface) is in force while the
    session's tests run. Subprocesses get it with ``s3.environ()``, tests.dist ranks with
    ``env=s3.env``. Fails (never skips) if it cannot start."""
    from tests.s3server import S3Server, ServerError, apply_env

    server = S3Server()
    try:
        server.start()
    except ServerError as e:
        pytest.fail(str(e), pytrace=False)
    saved = apply_env(server.env)
    try:
        yield server
    finally:
        apply_env(saved)
        server.stop()


@pytest.fixture
def aws_offline(monkeypatch):
    """For a test that names s3:// URLs without a server: the environment of
    tests.s3server.offline_env with the endpoint at a closed loopback port, so that a client
    built by mistake fails at once, on this machine (no credentials, region or endpoint
    looked up elsewhere)."""
    from tests.s3server import CLOSED, offline_env

    for k, v in offline_env(CLOSED).items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def uninterrupted_losses():
    """Losses of tests.test_trainer's run (2 ranks, ZeRO-2, fp32, STEPS steps) without any
    checkpoint: the reference every resumed run of that configuration must equal. Computed
    once per session (four tests compared against their own copy of it)."""
    from tests import dist
    from tests.test_trainer import STEPS, _train

    return dist.run(_train, 2, 2, 1, STEPS)[0][0]


@pytest.fixture
def shm():
    """A fresh directory in host memory (/dev/shm) for memory-tier snapshots, removed after."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="memtier-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)
