"""The client's side of the wire, against a stand-in manager on a Unix socket (no VM): what
it sends, how it reads plain, chunked and streamed answers, and the errors it raises."""

import asyncio
import io
import json
import os
import socket
import threading

import pytest

import mayfly
from mayfly.aio import AsyncClient, AsyncSandbox


class FakeManager:
    """Answers each connection with the next canned response and records the request."""

    def __init__(self, path):
        self.path = path
        self.responses = []
        self.requests = []
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(16)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def answer(self, status, body=b"", headers=None, chunks=None):
        self.responses.append((status, body, headers or {}, chunks))

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, rest = data.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append((lines[0], headers, rest))
                status, body, extra, chunks = self.responses.pop(0)
                out = f"HTTP/1.1 {status} X\r\nConnection: close\r\n"
                for k, v in extra.items():
                    out += f"{k}: {v}\r\n"
                if chunks is not None:
                    out += "Transfer-Encoding: chunked\r\n\r\n"
                    payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
                else:
                    out += f"Content-Length: {len(body)}\r\n\r\n"
                    payload = body
                conn.sendall(out.encode() + payload)

    def close(self):
        self.server.close()


@pytest.fixture
def fake(tmp_path):
    m = FakeManager(str(tmp_path / "m.sock"))
    yield m
    m.close()


def client(fake, token="admin-token"):
    return mayfly.Client(sock=fake.path, token=token)


def test_exec_sends_the_command_and_reads_the_verdict(fake):
    fake.answer(200, json.dumps({
        "exit": {"exit_code": 3, "signal": None, "timed_out": False, "wall_ms": 1.5,
                 "user_cpu_ms": 0.1, "sys_cpu_ms": 0.2, "max_rss_kib": 900, "error": None},
        "stdout": "out\n", "stderr_base64": "/w==", "stderr_dropped": 7,
    }).encode())
    sb = mayfly.Sandbox("box", token="own-token", client=client(fake))
    r = sb.exec(["ls", "-l"], env={"A": "1"}, cwd="/tmp", timeout=2.5, stdin=b"\x00\x01")
    line, headers, body = fake.requests[0]
    assert line == "POST /sandboxes/box/vm/exec HTTP/1.1"
    assert headers["authorization"] == "Bearer own-token"
    assert json.loads(body) == {"argv": ["ls", "-l"], "env": {"A": "1"}, "cwd": "/tmp",
                                "timeout_ms": 2500, "stdin_base64": "AAE="}
    assert (r.exit_code, r.stdout, r.stderr_bytes, r.stderr_dropped, r.ok) == (3, "out\n", b"\xff", 7, False)
    assert r.max_rss_kib == 900
    with pytest.raises(mayfly.CommandError) as e:
        r.check()
    assert e.value.result is r and "exited 3" in str(e.value)


def test_a_streamed_exec_calls_back_as_output_comes(fake):
    lines = [{"started": {"pid": 42}}, {"stdout": "a"}, {"stderr": "b"}, {"stdout_base64": "Yw=="},
             {"exit": {"exit_code": 0, "timed_out": False}}]
    chunks = [json.dumps(l).encode() + b"\n" for l in lines]
    # A line split across chunks is put back together.
    chunks = [chunks[0][:5], chunks[0][5:]] + chunks[1:]
    fake.answer(200, chunks=chunks)
    out, err = [], []
    r = mayfly.Sandbox("box", client=client(fake)).exec("echo a", on_stdout=out.append, on_stderr=err.append)
    assert json.loads(fake.requests[0][2]) == {"shell": "echo a", "stream": True}
    assert fake.requests[0][1]["authorization"] == "Bearer admin-token"
    assert (out, err, r.stdout, r.stderr, r.pid, r.exit_code) == (["a", "c"], ["b"], "ac", "b", 42, 0)


def test_a_stream_that_breaks_off_is_an_error_not_a_verdict(fake):
    fake.answer(200, chunks=[b'{"stdout": "partial"}\n'])
    with pytest.raises(mayfly.MayflyError, match="without an exit record"):
        mayfly.Sandbox("box", client=client(fake)).exec("x", on_stdout=lambda s: None)
    fake.answer(200, chunks=[b'{"error": "the agent went away"}\n'])
    with pytest.raises(mayfly.VMMError, match="the agent went away"):
        mayfly.Sandbox("box", client=client(fake)).exec("x", on_stdout=lambda s: None)


@pytest.mark.parametrize("status,kind", [
    (400, mayfly.BadRequest), (401, mayfly.Unauthorized), (403, mayfly.Unauthorized),
    (404, mayfly.NotFound), (409, mayfly.Conflict), (429, mayfly.OverBudget),
    (502, mayfly.VMMError), (503, mayfly.Busy), (504, mayfly.TimedOut), (500, mayfly.VMMError),
])
def test_errors_carry_the_managers_message(fake, status, kind):
    fake.answer(status, json.dumps({"error": f"what to do about {status}"}).encode())
    with pytest.raises(kind) as e:
        mayfly.Sandbox("box", client=client(fake)).info()
    assert (e.value.status, str(e.value)) == (status, f"what to do about {status}")


def test_files_are_sent_and_read_as_bytes(fake, tmp_path):
    big = os.urandom(300_000)
    src = tmp_path / "src"
    src.write_bytes(big)
    fake.answer(200, json.dumps({"bytes": len(big)}).encode())
    sb = mayfly.Sandbox("box", client=client(fake))
    with open(src, "rb") as f:
        assert sb.files.write("/a dir/f+1", f, mode=0o600, mkdirs=True) == len(big)
    line, headers, body = fake.requests[0]
    assert line == "PUT /sandboxes/box/vm/files?path=%2Fa%20dir%2Ff%2B1&mode=0600&mkdirs=1 HTTP/1.1"
    assert body == big and headers["content-length"] == str(len(big))
    fake.answer(200, chunks=[big[:1000], big[1000:]])
    assert sb.files.read("/f") == big
    fake.answer(200, chunks=[b"x" * 10])
    sink = io.BytesIO()
    sb.files.download("/f", sink)
    assert sink.getvalue() == b"x" * 10
    fake.answer(200, json.dumps({"entries": [{"name": "f", "type": "file", "size": 1, "mode": 420,
                                              "mtime_ms": 5}], "count": 1, "truncated": False}).encode())
    assert sb.files.list("/") == [mayfly.Entry("f", "file", 1, 420, 5)]
    fake.answer(404, b'{"error": "no such file"}')
    assert sb.files.exists("/nope") is False
    fake.answer(204)
    sb.files.remove("/d", recursive=True)
    assert fake.requests[-1][0] == "DELETE /sandboxes/box/vm/files?path=%2Fd&recursive=1 HTTP/1.1"


def test_bad_input_is_refused_before_anything_is_sent(fake):
    sb = mayfly.Sandbox("box", client=client(fake))
    with pytest.raises(ValueError, match="DNS label"):
        mayfly.Sandbox("../etc", client=client(fake))
    with pytest.raises(TypeError):
        sb.exec([])
    with pytest.raises(ValueError):
        sb.exec("true", timeout=0)
    with pytest.raises(ValueError):
        sb.fork(0)
    with pytest.raises(ValueError):
        sb.fork(3, names=["a", "b"])
    assert fake.requests == []


def test_an_absent_manager_says_so(tmp_path):
    c = mayfly.Client(sock=str(tmp_path / "none.sock"), token="t")
    with pytest.raises(mayfly.ManagerUnreachable, match="is `mayfly serve"):
        c.sandboxes()
    with pytest.raises(mayfly.ManagerUnreachable):
        asyncio.run(AsyncClient(sock=str(tmp_path / "none.sock"), token="t").sandboxes())


def test_no_socket_configured_is_an_error(monkeypatch):
    monkeypatch.delenv("MAYFLY_SOCK", raising=False)
    with pytest.raises(mayfly.MayflyError, match="MAYFLY_SOCK"):
        mayfly.Client()


def test_the_state_dir_gives_the_admin_token(tmp_path, fake):
    (tmp_path / "admin.token").write_text("from-file\n")
    c = mayfly.Client(sock=fake.path, state_dir=str(tmp_path))
    assert c.token == "from-file"


def test_asyncio_reads_the_same_answers(fake):
    fake.answer(201, json.dumps({"name": "box", "state": "running", "token": "t1",
                                 "spec": {"probe": True}}).encode())
    fake.answer(200, chunks=[b'{"stdout": "hi"}\n{"exit": {"exit_code": 0}}\n'])
    fake.answer(200, json.dumps({"exit": {"exit_code": 1}, "stdout": "", "stderr": "no"}).encode())
    fake.answer(201, json.dumps({"source": "box", "clones": [{"name": "box-1", "token": "t2"}],
                                 "ms": 1, "snapshot_ms": 1}).encode())
    fake.answer(403, b'{"error": "not yours"}')

    async def go():
        c = AsyncClient(sock=fake.path, token="admin")
        sb = await AsyncSandbox.create(name="box", idle_timeout=5, client=c)
        seen = []
        r = await sb.exec("echo hi", on_stdout=seen.append)
        assert (seen, r.stdout, r.exit_code) == (["hi"], "hi", 0)
        with pytest.raises(mayfly.CommandError):
            await sb.exec("false", check=True)
        (clone,) = await sb.fork(1)
        assert (clone.name, clone.token) == ("box-1", "t2")
        with pytest.raises(mayfly.Unauthorized, match="not yours"):
            await clone.info()

    asyncio.run(go())
    assert json.loads(fake.requests[0][2]) == {"name": "box", "idle_timeout_s": 5}
    assert fake.requests[1][1]["authorization"] == "Bearer t1"
    assert fake.requests[3][1]["authorization"] == "Bearer admin"
    assert fake.requests[4][1]["authorization"] == "Bearer t2"


def test_a_compressed_file_object_is_sent_as_its_contents(fake, tmp_path):
    import gzip
    data = os.urandom(50_000) * 4
    with gzip.open(tmp_path / "f.gz", "wb") as f:
        f.write(data)
    fake.answer(200, json.dumps({"bytes": len(data)}).encode())
    with gzip.open(tmp_path / "f.gz", "rb") as f:
        mayfly.Sandbox("box", client=client(fake)).files.write("/f", f)
    assert fake.requests[0][2] == data


def test_a_refusal_before_the_body_is_read_still_carries_the_message(tmp_path):
    path = str(tmp_path / "r.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def refuse():
        conn, _ = server.accept()
        conn.recv(1024)
        body = b'{"error": "the token is not this sandbox\'s"}'
        conn.sendall(b"HTTP/1.1 403 X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    t = threading.Thread(target=refuse, daemon=True)
    t.start()
    with pytest.raises(mayfly.Unauthorized, match="not this sandbox"):
        mayfly.Sandbox("box", client=mayfly.Client(sock=path, token="t")).files.write("/f", b"x" * (8 << 20))
    t.join()
    server.close()


def test_a_revoked_token_is_not_used_again(fake):
    fake.answer(200, b'{"name": "box", "token": null}')
    fake.answer(200, b'{"name": "box", "state": "running"}')
    sb = mayfly.Sandbox("box", token="own", client=client(fake))
    sb.revoke_token()
    sb.info()
    assert fake.requests[1][1]["authorization"] == "Bearer admin-token"


def test_a_sandbox_without_an_agent_is_not_waited_for(fake):
    # Its guest routes answer 409 at once: a create that waited for its agent would fail.
    fake.answer(201, json.dumps({"name": "own", "state": "running", "token": "t1",
                                 "spec": {"no_agent": True}}).encode())
    sb = mayfly.Sandbox.create(name="own", no_agent=True, client=client(fake))
    assert sb.name == "own"
    assert len(fake.requests) == 1
    assert json.loads(fake.requests[0][2]) == {"name": "own", "no_agent": True}


def test_ports_and_policy_are_sent_as_the_manager_takes_them(fake):
    fake.answer(201, b'{"guest_port": 8080, "host": "tcp:127.0.0.1:41234"}')
    fake.answer(200, b'{"name": "box", "ports": [{"guest_port": 8080, "host": "tcp:127.0.0.1:41234", "listening": true}]}')
    fake.answer(200, b'{"name": "box", "guest_port": 8080, "closed": true}')
    fake.answer(200, b'{"policy": "allow=pypi.org:443"}')
    sb = mayfly.Sandbox("box", token="own", client=client(fake))
    assert sb.expose(8080)["host"] == "tcp:127.0.0.1:41234"
    assert sb.ports()[0]["guest_port"] == 8080
    sb.close_port(8080)
    assert sb.set_policy("allow=pypi.org:443")["policy"] == "allow=pypi.org:443"
    lines = [r[0] for r in fake.requests]
    assert lines == [
        "POST /sandboxes/box/ports HTTP/1.1",
        "GET /sandboxes/box/ports HTTP/1.1",
        "DELETE /sandboxes/box/ports/8080 HTTP/1.1",
        "PUT /sandboxes/box/vm/net/policy HTTP/1.1",
    ]
    assert json.loads(fake.requests[0][2]) == {"guest_port": 8080}
    # The admin's routes go with the client's (admin) token, the list with the sandbox's own.
    assert fake.requests[0][1]["authorization"] == "Bearer admin-token"
    assert fake.requests[1][1]["authorization"] == "Bearer own"
    with pytest.raises(ValueError):
        sb.expose(0)
    assert len(fake.requests) == 4


def test_credentials_are_minted_revoked_and_verified_for_an_audience(fake):
    fake.answer(200, b'{"name": "box", "credential": "mfc_x", "delivered": false}')
    fake.answer(200, b'{"name": "box", "revoked": true}')
    fake.answer(200, b'{"valid": false, "error": "revoked"}')
    sb = mayfly.Sandbox("box", token="own", client=client(fake))
    minted = sb.mint_credential(audience="billing", ttl=60)
    assert (minted["credential"], minted["delivered"]) == ("mfc_x", False)
    sb.revoke_credential()
    assert sb.client.verify_credential("mfc_x", audience="billing")["valid"] is False
    lines = [r[0] for r in fake.requests]
    assert lines == [
        "POST /sandboxes/box/credential HTTP/1.1",
        "DELETE /sandboxes/box/credential HTTP/1.1",
        "POST /credentials/verify HTTP/1.1",
    ]
    assert json.loads(fake.requests[0][2]) == {"audience": "billing", "ttl_s": 60}
    assert json.loads(fake.requests[2][2]) == {"credential": "mfc_x", "audience": "billing"}
    # The admin's routes, all three.
    assert all(r[1]["authorization"] == "Bearer admin-token" for r in fake.requests)
    for bad in [{"ttl": 0.5}, {"ttl": -1}, {"audience": ""}]:
        with pytest.raises(ValueError):
            sb.mint_credential(**bad)
    assert len(fake.requests) == 3


def test_a_templates_network_is_sent_as_net():
    assert mayfly.Template(setup=["true"], network="allow=pypi.org:443").to_json() == {
        "setup": ["true"],
        "net": "allow=pypi.org:443",
    }
