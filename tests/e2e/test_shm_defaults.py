"""The shm budget and the client quota default from what /dev/shm holds: in Docker's default
64 MB /dev/shm, a session too big for it is refused naming /dev/shm and shm_size / sizeLimit
first, not a client quota of 512 MiB that raising would not help. Real ``batchd-server
serve``, real client, in a private 64 MB tmpfs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from shmns import run_with_small_shm, unavailable_reason

TESTS = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, threading
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    import batchd
    from batchd import errors
    from batchd_server.catalog import migrate
    from batchd_server.catalog.db import make_engine
    from serving import record_dataset

    tmp = Path({tmp!r})
    url = f"sqlite:///{{tmp}}/catalog.db"
    engine = make_engine(url)
    migrate.upgrade(engine)
    record_dataset(engine, tmp / "big", n=8, floats=256 * 1024)  # 1 MiB each
    engine.dispose()
    sock = tmp / "batchd.sock"
    env = {{**os.environ, "BATCHD_DATABASE_URL": url}}
    serve = [sys.executable, "-m", "batchd_server.cli", "serve", "--workers", "1"]
    server = subprocess.Popen(
        serve + ["--listen", f"unix://{{sock}}"], env=env, stderr=subprocess.PIPE, text=True
    )
    log = []
    out = {{"log": log}}
    try:
        for line in server.stderr:
            log.append(line)
            if "ready: serving on" in line:
                break
        else:
            raise SystemExit(f"the server exited {{server.wait()}} before it was ready: {{log}}")
        threading.Thread(target=lambda: log.extend(server.stderr), daemon=True).start()
        spec = batchd.Array((256 * 1024,), "float32", raw=True)
        target = f"unix://{{sock}}"
        try:  # 6 slots of 100 MiB: past the 512 MiB quota of a roomy /dev/shm
            batchd.Loader(target, dataset="records", batch_size=100, pipeline=spec)
        except errors.ResourceExhausted as e:
            out["refused"] = str(e)
        with batchd.Loader(target, dataset="records", batch_size=2, pipeline=spec) as loader:
            out["served"] = sum(len(b["sample_id"]) for b in loader)
    finally:
        server.send_signal(signal.SIGTERM)
        out["exit"] = server.wait(60)
    print(json.dumps(out))
    """
)


def test_in_a_64mb_dev_shm_an_oversized_session_is_refused_naming_dev_shm_not_the_quota(
    tmp_path: Path,
) -> None:
    """``batchd-server serve`` with no shm settings in a 64 MB /dev/shm: a session of 600 MiB
    is refused with a message that starts with /dev/shm's size and names shm_size and
    sizeLimit, not the client quota; a session that fits is served; the server exits 0."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot mount a private 64 MB tmpfs on /dev/shm here: {reason}")
    script = _SCRIPT.format(tests=str(TESTS), tmp=str(tmp_path))
    done = run_with_small_shm(script, size="64m", timeout_s=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    out = json.loads(done.stdout.splitlines()[-1])
    log = "".join(out["log"])
    assert out["exit"] == 0 and out["served"] == 8, log
    refused = out.get("refused", "")
    assert "/dev/shm is 64.0 MiB in all" in refused, refused
    assert refused.index("/dev/shm") < refused.index("shm_size: 1gb") < refused.index("sizeLimit")
    assert "quota of" not in refused and "raise the quota" not in refused, refused
