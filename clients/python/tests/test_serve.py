"""The client against a real `mayfly serve` with Linux guests (run by tests/guest_python.rs
inside tests/run: it starts the manager and sets MAYFLY_SOCK and MAYFLY_STATE_DIR). Without
a manager these tests fail; they never skip."""

import asyncio
import hashlib
import json
import os
import time

import pytest

import mayfly
from mayfly.aio import AsyncClient, AsyncSandbox

# One template for the whole run, so the manager boots and sets it up once.
TEMPLATE = mayfly.Template(setup=["mkdir -p /task && echo from-the-template > /task/motd"])


@pytest.fixture(scope="session")
def client():
    if not os.environ.get("MAYFLY_SOCK"):
        pytest.fail("MAYFLY_SOCK is not set: these tests need a running `mayfly serve` "
                    "(tests/run starts one through tests/tests/guest_python.rs)")
    return mayfly.Client()


def test_the_life_cycle(client, tmp_path):
    with mayfly.Sandbox.create(TEMPLATE, name="py-life", client=client, acts_for="tests") as sb:
        assert sb.token and sb.state == "running"
        r = sb.exec("cat /task/motd; mayfly-identity name")
        assert (r.exit_code, r.stdout, r.ok) == (0, "from-the-template\npy-life\n", True)
        # Its credential is in the guest, and the manager says whose it is.
        card = json.loads(sb.files.read_text("/run/mayfly/sandbox.json"))
        verdict = client.verify_credential(card["credential"])
        assert (verdict["valid"], verdict["sandbox"], verdict["acts_for"]) == (True, "py-life", "tests")
        # A new one, for an audience: the one before stops verifying; revoked, none does.
        minted = sb.mint_credential(audience="billing", ttl=600)
        assert client.verify_credential(minted["credential"], audience="billing")["valid"]
        assert not client.verify_credential(minted["credential"], audience="storage")["valid"]
        assert not client.verify_credential(card["credential"])["valid"]
        sb.revoke_credential()
        assert "revoked" in client.verify_credential(minted["credential"])["error"]

        # Status, stderr, env, cwd, stdin, argv.
        r = sb.exec("echo oops >&2; exit 7")
        assert (r.exit_code, r.stderr, r.ok) == (7, "oops\n", False)
        with pytest.raises(mayfly.CommandError, match="oops"):
            sb.exec("echo oops >&2; exit 7", check=True)
        r = sb.exec(["sh", "-c", 'echo "$GREETING $(pwd)"; cat'], env={"GREETING": "hi"},
                    cwd="/task", stdin="from stdin")
        assert r.stdout == "hi /task\nfrom stdin"
        r = sb.exec("sleep 30", timeout=1)
        assert r.timed_out and not r.ok
        seen = []
        r = sb.exec("for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=seen.append)
        assert "".join(seen) == r.stdout == "line1\nline2\nline3\n" and r.ok

        # Files: text, a binary file streamed from disk, listing, metadata, removal.
        blob = os.urandom(3 << 20)
        src = tmp_path / "blob"
        src.write_bytes(blob)
        with open(src, "rb") as f:
            assert sb.files.write("/root/in/blob", f, mkdirs=True) == len(blob)
        assert sb.files.read("/root/in/blob") == blob
        assert sb.exec("sha256sum /root/in/blob | cut -d' ' -f1").stdout.strip() == \
            hashlib.sha256(blob).hexdigest()
        sb.files.write("/root/in/note.txt", "a note", mode=0o600)
        names = sorted(e.name for e in sb.files.list("/root/in"))
        assert names == ["blob", "note.txt"]
        st = sb.files.stat("/root/in/note.txt")
        assert (st.type, st.size, st.mode) == ("file", 6, 0o600)
        sb.files.mkdir("/root/in/a/b")
        assert sb.files.stat("/root/in/a/b").type == "dir"
        sb.files.remove("/root/in/a", recursive=True)
        assert not sb.files.exists("/root/in/a")
        with pytest.raises(mayfly.NotFound):
            sb.files.read("/root/in/none")

        # A process and a file survive a sleep on disk; the next exec wakes it.
        pid = int(sb.exec("setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!").stdout)
        before = sb.info()["pid"]
        assert sb.pause()["state"] == "suspended"
        assert sb.info()["pid"] is None
        r = sb.exec(f"cat /root/in/note.txt; echo; kill -0 {pid} && echo alive")
        assert r.stdout == "a note\nalive\n"
        info = sb.info()
        assert info["state"] == "running" and info["wakes"] == 1 and info["pid"] != before
        sb.pause()
        assert sb.resume()["state"] == "running"

        # Fork: clones of their own, each with the files and its own name.
        clones = sb.fork(names=["py-life-a", "py-life-b"])
        try:
            for c in clones:
                r = c.exec(f"cat /root/in/note.txt; echo; kill -0 {pid} && echo alive; mayfly-identity name")
                assert r.stdout == f"a note\nalive\n{c.name}\n"
                c.files.write("/root/mine", c.name)
            assert clones[0].files.read_text("/root/mine") == "py-life-a"
            assert not sb.files.exists("/root/mine")
        finally:
            for c in clones:
                c.delete()
    # The context manager deleted it.
    with pytest.raises(mayfly.NotFound):
        mayfly.Sandbox.connect("py-life", client=client)


def test_errors_say_what_went_wrong(client):
    with mayfly.Sandbox.create(TEMPLATE, name="py-err", client=client) as sb:
        with pytest.raises(mayfly.Conflict, match="py-err"):
            mayfly.Sandbox.create(TEMPLATE, name="py-err", client=client)
        with pytest.raises(mayfly.NotFound):
            mayfly.Sandbox.connect("py-none", client=client)
        with mayfly.Sandbox.create(TEMPLATE, name="py-other", client=client) as other:
            # One sandbox's token cannot touch another, or make sandboxes.
            as_other = mayfly.Sandbox("py-err", token=other.token, client=client)
            with pytest.raises(mayfly.Unauthorized):
                as_other.exec("true")
            mine = mayfly.Client(sock=client.sock, token=sb.token)
            with pytest.raises(mayfly.Unauthorized):
                mayfly.Sandbox.create(TEMPLATE, name="py-x", client=mine)
            # A revoked token stops working; a renewed one works.
            old = sb.token
            sb.revoke_token()
            with pytest.raises(mayfly.Unauthorized):
                mayfly.Sandbox("py-err", token=old, client=client).exec("true")
            sb.renew_token()
            assert sb.exec("true").ok
        # A template whose setup fails names the command and its output, and leaves nothing.
        bad = mayfly.Template(setup=["echo starting", "echo broken-step >&2; exit 4"])
        with pytest.raises(mayfly.BadRequest) as e:
            mayfly.Sandbox.create(bad, name="py-bad", client=client)
        assert "exited with 4" in str(e.value) and "broken-step" in str(e.value), str(e.value)
        assert "py-bad" not in [s["name"] for s in client.sandboxes()]
    # Gone: the admin hears so; its own token gets the same answer as any stranger's.
    with pytest.raises(mayfly.NotFound):
        mayfly.Sandbox("py-err", client=client).exec("true")
    with pytest.raises(mayfly.Unauthorized):
        sb.exec("true")


def test_fifty_execs_across_ten_sandboxes_with_asyncio(client):
    async def go():
        c = AsyncClient(sock=client.sock, token=client.token)
        source = await AsyncSandbox.create(TEMPLATE, name="py-fan", client=c)
        sandboxes = [source]
        try:
            sandboxes += await source.fork(9)
            assert len({s.name for s in sandboxes}) == 10
            start = time.monotonic()
            runs = [(s, i) for i in range(5) for s in sandboxes]
            results = await asyncio.gather(*(
                s.exec(f"echo {i} $(mayfly-identity name) $(cat /task/motd)") for s, i in runs
            ))
            took = time.monotonic() - start
            for (s, i), r in zip(runs, results):
                assert r.ok and r.stdout == f"{i} {s.name} from-the-template\n", r
            print(f"50 execs across 10 sandboxes in {took:.2f} s")
        finally:
            await asyncio.gather(*(s.delete() for s in sandboxes), return_exceptions=True)
        left = [x["name"] for x in await c.sandboxes() if x["name"].startswith("py-fan")]
        assert left == []

    asyncio.run(go())
