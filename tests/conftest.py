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
    """A real S3-protocol server (moto) on 127.0.0.1, a free port; the standard AWS
    environment points at it while the session's tests run. Fails (never skips) if it
    cannot start."""
    from tests.s3server import S3Server, ServerError

    server = S3Server()
    try:
        server.start()
    except ServerError as e:
        pytest.fail(str(e), pytrace=False)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


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
