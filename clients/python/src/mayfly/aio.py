"""The asyncio client, for fan-out: :class:`AsyncClient` and :class:`AsyncSandbox` mirror
:class:`mayfly.Client` and :class:`mayfly.Sandbox` method for method, with ``await``.
Each request is its own connection to the manager's socket, and no threads; a client sends
at most ``max_requests`` (64) at once and queues the rest, under the manager's own limit of
256 connections (past which it answers 503, ``mayfly.Busy``)::

    async with await AsyncSandbox.create() as sb:
        clones = await sb.fork(10)
        results = await asyncio.gather(*(c.exec("echo hi") for c in clones))
"""

from __future__ import annotations

import asyncio
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _api
from ._api import Call, Command, Data, Entry, Result, Stat, Template
from .errors import Busy, ManagerUnreachable, MayflyError, NotFound, TimedOut

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncFiles"]

#: The longest head (status line and headers) read from the manager.
_MAX_HEAD = 64 * 1024


class AsyncClient:
    """A connection to ``mayfly serve`` (see :class:`mayfly.Client`)."""

    def __init__(
        self,
        sock: Optional[str] = None,
        token: Optional[str] = None,
        state_dir: Optional[str] = None,
        timeout: float = _api.DEFAULT_TIMEOUT,
        max_requests: int = 64,
    ) -> None:
        """``max_requests``: at most this many of this client's requests at once (the rest
        wait their turn), well under the manager's 256 connections."""
        self.sock, self.token = _api.resolve(sock, token, state_dir)
        self.timeout = timeout
        if max_requests < 1:
            raise ValueError(f"max_requests must be 1 or more, not {max_requests}")
        self.max_requests = max_requests
        self._slots: Dict[int, asyncio.Semaphore] = {}

    def __repr__(self) -> str:
        return f"mayfly.aio.AsyncClient(sock={self.sock!r})"

    async def do(self, call: Call, token: Optional[str] = None) -> Any:
        """Send one request and parse its answer (or raise the manager's error)."""
        timeout = self.timeout if call.timeout == _api.DEFAULT_TIMEOUT else call.timeout
        # One semaphore per event loop (a client may outlive an asyncio.run).
        loop = id(asyncio.get_running_loop())
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.max_requests))
        async with slots:
            try:
                return await asyncio.wait_for(self._exchange(call, token or self.token), timeout)
            except asyncio.TimeoutError:
                raise TimedOut(f"{call.method} {call.path}: no answer in {timeout} s") from None

    async def _exchange(self, call: Call, token: Optional[str]) -> Any:
        try:
            reader, writer = await asyncio.open_unix_connection(self.sock, limit=_MAX_HEAD)
        except FileNotFoundError:
            raise ManagerUnreachable(
                f"no manager at {self.sock}: is `mayfly serve --sock {self.sock}` running?"
            ) from None
        except ConnectionRefusedError:
            raise ManagerUnreachable(
                f"the manager at {self.sock} refuses connections: it has stopped "
                "(start `mayfly serve` again on the same --state-dir; it finds its sandboxes)"
            ) from None
        try:
            writer.write(_api.request_head(call, token, _api.body_length(call)))
            try:
                if isinstance(call.body, bytes):
                    writer.write(call.body)
                elif call.body is not None:
                    while True:
                        piece = call.body.read(1 << 16)
                        if not piece:
                            break
                        writer.write(piece)
                        await writer.drain()
                await writer.drain()
            except (BrokenPipeError, ConnectionResetError):
                # Refused before the body was read: the manager's answer may be waiting.
                pass
            status, headers = await _read_head(reader)
            body = _Body(reader, headers)
            if not 200 <= status < 300:
                _api.raise_for(status, await body.read_all())
            if call.stream is not None:
                pending = b""
                async for piece in body:
                    pending += piece
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        call.stream.feed(line)
                call.stream.feed(pending)
                return call.parse(status, b"")
            if call.sink is not None:
                async for piece in body:
                    call.sink.write(piece)
                return None
            return call.parse(status, await body.read_all())
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            raise ManagerUnreachable(
                f"{call.method} {call.path}: the manager at {self.sock} went away mid-answer ({e!r})"
            ) from None
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def sandboxes(self) -> List[Dict[str, Any]]:
        return await self.do(_api.list_sandboxes())  # type: ignore[no-any-return]

    async def verify_credential(
        self, credential: str, audience: Optional[str] = None
    ) -> Dict[str, Any]:
        return await self.do(_api.verify_credential(credential, audience))  # type: ignore[no-any-return]

    async def metrics(self) -> str:
        return await self.do(_api.metrics())  # type: ignore[no-any-return]


async def _read_head(reader: asyncio.StreamReader) -> Tuple[int, Dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise MayflyError(f"the manager answered with a bad status line {lines[0]!r}")
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


class _Body:
    """An answer's body as it arrives: by Content-Length, chunked, or to the end."""

    def __init__(self, reader: asyncio.StreamReader, headers: Mapping[str, str]) -> None:
        self._reader = reader
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left: Optional[int] = int(length) if length is not None and not self._chunked else None

    def __aiter__(self) -> "_Body":
        return self

    async def __anext__(self) -> bytes:
        if self._chunked:
            size_line = await self._reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                # The trailer, up to its empty line.
                while (await self._reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                raise StopAsyncIteration
            data = await self._reader.readexactly(size)
            await self._reader.readexactly(2)
            return data
        if self._left is not None:
            if self._left == 0:
                raise StopAsyncIteration
            data = await self._reader.read(min(self._left, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", self._left)
            self._left -= len(data)
            return data
        data = await self._reader.read(1 << 16)
        if not data:
            raise StopAsyncIteration
        return data

    async def read_all(self) -> bytes:
        return b"".join([piece async for piece in self])


class AsyncFiles:
    """A sandbox's files (see :class:`mayfly.Files`)."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def write(
        self,
        path: str,
        data: Data,
        mode: Optional[int] = None,
        mkdirs: bool = False,
        atomic: bool = True,
    ) -> int:
        return await self._sb._do(_api.write_file(self._sb.name, path, data, mode, mkdirs, atomic))  # type: ignore[no-any-return]

    async def read(self, path: str) -> bytes:
        return await self._sb._do(_api.read_file(self._sb.name, path, None))  # type: ignore[no-any-return]

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def download(self, path: str, into: IO[bytes]) -> None:
        await self._sb._do(_api.read_file(self._sb.name, path, into))

    async def list(self, path: str) -> List[Entry]:
        return await self._sb._do(_api.list_dir(self._sb.name, path))  # type: ignore[no-any-return]

    async def stat(self, path: str, follow: bool = True) -> Stat:
        return await self._sb._do(_api.stat_file(self._sb.name, path, follow))  # type: ignore[no-any-return]

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._sb._do(_api.remove_file(self._sb.name, path, recursive))

    async def mkdir(self, path: str, mode: Optional[int] = None, parents: bool = True) -> None:
        await self._sb._do(_api.make_dir(self._sb.name, path, mode, parents))


class AsyncSandbox:
    """A sandbox by name (see :class:`mayfly.Sandbox`); ``async with`` deletes it on leaving."""

    def __init__(
        self, name: str, token: Optional[str] = None, client: Optional[AsyncClient] = None
    ):
        self.name = _api.check_name(name)
        self.token = token
        self.client = client or AsyncClient()
        self.files = AsyncFiles(self)
        self.created: Dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"mayfly.aio.AsyncSandbox({self.name!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.delete()
        except NotFound:
            pass

    async def _do(self, call: Call) -> Any:
        return await self.client.do(call, None if call.admin else self.token)

    @classmethod
    async def create(
        cls,
        template: Union[Template, Mapping[str, Any], None] = None,
        name: Optional[str] = None,
        idle_timeout: Optional[float] = None,
        network: Optional[str] = None,
        *,
        snapshot: Optional[str] = None,
        client: Optional[AsyncClient] = None,
        wait: bool = True,
        ready_timeout: float = 300.0,
        **spec: Any,
    ) -> "AsyncSandbox":
        client = client or AsyncClient()
        name = name or _api.new_name()
        try:
            answer = await client.do(
                _api.create(name, template, idle_timeout, network, snapshot, spec)
            )
        except (TimedOut, ManagerUnreachable) as e:
            try:
                await client.do(_api.delete(name))
            except MayflyError:
                pass
            raise type(e)(f"creating sandbox {name}: {e} (deleted if it was made)", e.status) from None
        sandbox = cls(answer["name"], answer.get("token"), client)
        sandbox.created = answer
        if wait and not _api.agentless(answer):
            try:
                await sandbox.wait_ready(ready_timeout)
            except BaseException:
                try:
                    await sandbox.delete()
                except MayflyError:
                    pass
                raise
        return sandbox

    @classmethod
    async def connect(
        cls, name: str, token: Optional[str] = None, client: Optional[AsyncClient] = None
    ) -> "AsyncSandbox":
        sandbox = cls(name, token, client)
        await sandbox.info()
        return sandbox

    async def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._do(_api.agent(self.name, timeout=30.0))
                return
            except (Busy, TimedOut) as e:
                if time.monotonic() >= deadline:
                    raise TimedOut(
                        f"sandbox {self.name}: its guest agent did not answer in {timeout} s ({e})"
                    ) from None
                await asyncio.sleep(0.2)

    async def info(self) -> Dict[str, Any]:
        return await self._do(_api.describe(self.name))  # type: ignore[no-any-return]

    async def exec(
        self,
        cmd: Command,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        stdin: Optional[Union[str, bytes]] = None,
        on_stdout: Optional[Callable[[str], None]] = None,
        on_stderr: Optional[Callable[[str], None]] = None,
        user: Optional[Union[str, int]] = None,
        check: bool = False,
    ) -> Result:
        result: Result = await self._do(
            _api.exec_call(self.name, cmd, env, cwd, timeout, stdin, user, on_stdout, on_stderr)
        )
        return result.check() if check else result

    async def pause(self) -> Dict[str, Any]:
        return await self._do(_api.pause(self.name))  # type: ignore[no-any-return]

    async def resume(self) -> Dict[str, Any]:
        return await self._do(_api.resume(self.name))  # type: ignore[no-any-return]

    async def snapshot(self, path: str) -> Dict[str, Any]:
        return await self._do(_api.snapshot(self.name, path))  # type: ignore[no-any-return]

    async def fork(
        self,
        n: Optional[int] = None,
        names: Optional[Sequence[str]] = None,
        idle_timeout: Optional[float] = None,
    ) -> List["AsyncSandbox"]:
        answer = await self._do(_api.fork(self.name, n, names, idle_timeout))
        clones = []
        for c in answer["clones"]:
            clone = type(self)(c["name"], c.get("token"), self.client)
            clone.created = c
            clones.append(clone)
        return clones

    async def set_policy(self, policy: str) -> Dict[str, Any]:
        return await self._do(_api.set_policy(self.name, policy))  # type: ignore[no-any-return]

    async def expose(self, guest_port: int, host: Optional[str] = None) -> Dict[str, Any]:
        return await self._do(  # type: ignore[no-any-return]
            _api.expose_port(self.name, guest_port, host)
        )

    async def ports(self) -> List[Dict[str, Any]]:
        return await self._do(_api.list_ports(self.name))  # type: ignore[no-any-return]

    async def close_port(self, guest_port: int) -> None:
        await self._do(_api.close_port(self.name, guest_port))

    async def renew_token(self) -> str:
        self.token = await self._do(_api.renew_token(self.name))
        assert self.token is not None
        return self.token

    async def revoke_token(self) -> None:
        await self._do(_api.revoke_token(self.name))
        self.token = None

    async def mint_credential(
        self, audience: Optional[str] = None, ttl: Optional[float] = None
    ) -> Dict[str, Any]:
        return await self._do(_api.mint_credential(self.name, audience, ttl))  # type: ignore[no-any-return]

    async def revoke_credential(self) -> None:
        await self._do(_api.revoke_credential(self.name))

    async def delete(self) -> None:
        await self._do(_api.delete(self.name))
