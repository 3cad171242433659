//! A blocking client for the host side.
//!
//! [`AgentClient`] wraps an already-connected stream (for virtio-vsock: after the host did
//! the `CONNECT <port>` handshake on the device's Unix socket). One operation per
//! connection, so every op method takes `self`: a client cannot be reused by mistake.
//!
//! Nothing the agent sends is trusted: frames are bounded by [`crate::params::MAX_FRAME`] and every
//! frame that is not the one the session allows next is a [`ProtocolError::Unexpected`].

use std::io::{self, Cursor, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use serde::de::DeserializeOwned;

use crate::error::{Error, ProtocolError};
use crate::frame::{read_frame, write_frame};
use crate::frame_type::FrameType;
use crate::messages::*;
use crate::params::{CHUNK_SIZE, PROTOCOL_VERSION};

/// The largest HELLO this client accepts. A real one is a few hundred bytes; its list of ops
/// is held for the whole connection, so a frame-sized one would be a vector the agent sizes.
pub const MAX_HELLO: usize = 64 * 1024;

/// How much of each output stream [`AgentClient::exec_output`] keeps; the rest is counted in
/// [`ExecOutput::stdout_dropped`] and [`ExecOutput::stderr_dropped`].
pub const DEFAULT_OUTPUT_LIMIT: usize = 64 << 20;

/// A stream that can be split into a second handle for writing while one thread reads,
/// and shut down. Exec needs it: stdin and signals go out while output comes in.
pub trait Duplex: Read + Write + Send + Sized + 'static {
    /// Another handle to the same connection (e.g. `dup`).
    fn try_clone_stream(&self) -> io::Result<Self>;
    /// Shuts both directions, waking any thread blocked on the connection.
    fn shutdown_stream(&self) -> io::Result<()>;
}

impl Duplex for UnixStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_stream(&self) -> io::Result<()> {
        self.shutdown(Shutdown::Both)
    }
}

impl Duplex for TcpStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_stream(&self) -> io::Result<()> {
        self.shutdown(Shutdown::Both)
    }
}

/// The write half shared by exec's stdin thread and any [`Signaller`]s; the lock keeps
/// whole frames together.
type SharedWriter = Arc<Mutex<Box<dyn Write + Send>>>;

const RUNNING: u8 = 1;
const DONE: u8 = 2;

/// Where the exec on this connection is, for [`Signaller`]s. `phase` starts at 0: not
/// started.
#[derive(Debug, Default)]
struct ExecState {
    phase: AtomicU8,
    pid: AtomicU32,
}

fn write_shared(writer: &SharedWriter, frame: &[u8]) -> io::Result<()> {
    // A poisoned lock only means another writer panicked; the stream itself is still whole
    // frames, because each frame is written under the lock in one write_all.
    let mut w = writer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    w.write_all(frame)?;
    w.flush()
}

/// Sends signals to the program an [`AgentClient::exec`] is running. Get one with
/// [`AgentClient::signaller`] before calling `exec`, and use it from another thread.
#[derive(Clone)]
pub struct Signaller {
    writer: SharedWriter,
    state: Arc<ExecState>,
}

impl Signaller {
    /// Delivers `signal` to the program's process group. [`Error::NotRunning`] before
    /// STARTED arrived or after EXIT did.
    pub fn signal(&self, signal: i32) -> Result<(), Error> {
        if self.state.phase.load(Ordering::Acquire) != RUNNING {
            return Err(Error::NotRunning);
        }
        let frame = Message::Signal(SignalRequest { signal }).encode()?;
        write_shared(&self.writer, &frame).map_err(Error::Io)
    }

    /// The program's pid in the guest, once it started.
    /// Stays set after it exited; `None` if it never started.
    pub fn pid(&self) -> Option<u32> {
        // 0 is never a process's pid: it marks "not started".
        match self.state.pid.load(Ordering::Acquire) {
            0 => None,
            pid => Some(pid),
        }
    }

    /// Started and not yet exited.
    pub fn is_running(&self) -> bool {
        self.state.phase.load(Ordering::Acquire) == RUNNING
    }

    /// Where the program is, as a handle that holds nothing of the connection (a Signaller
    /// holds its writing side: kept by something the connection's reader owns, it would keep
    /// the connection open).
    pub fn status(&self) -> ExecStatus {
        ExecStatus {
            state: Arc::clone(&self.state),
        }
    }
}

/// Where the program an [`AgentClient::exec`] runs is: see [`Signaller::status`].
#[derive(Clone, Debug)]
pub struct ExecStatus {
    state: Arc<ExecState>,
}

impl ExecStatus {
    /// The program's pid in the guest, once it started (STARTED came); stays set after it
    /// exited. `None` if it never started.
    pub fn pid(&self) -> Option<u32> {
        match self.state.pid.load(Ordering::Acquire) {
            0 => None,
            pid => Some(pid),
        }
    }

    /// Started and not yet exited.
    pub fn is_running(&self) -> bool {
        self.state.phase.load(Ordering::Acquire) == RUNNING
    }
}

/// Options of [`AgentClient::write_file`]; the defaults are the protocol's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteFileOptions {
    pub mode: u32,
    pub atomic: bool,
    pub mkdirs: bool,
}

impl Default for WriteFileOptions {
    fn default() -> Self {
        WriteFileOptions {
            mode: 0o644,
            atomic: true,
            mkdirs: false,
        }
    }
}

impl WriteFileOptions {
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }
    pub fn atomic(mut self, atomic: bool) -> Self {
        self.atomic = atomic;
        self
    }
    pub fn mkdirs(mut self, mkdirs: bool) -> Self {
        self.mkdirs = mkdirs;
        self
    }
}

/// An exec's collected output, from [`AgentClient::exec_output`]: each stream up to its
/// limit, what did not fit counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecOutput {
    pub exit: ExitRecord,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Bytes of stdout past the limit: counted, not kept.
    pub stdout_dropped: u64,
    /// Bytes of stderr past the limit: counted, not kept.
    pub stderr_dropped: u64,
}

/// Keeps `data` in `kept` up to `limit` bytes in all; returns how many it did not keep.
fn keep_bounded(kept: &mut Vec<u8>, limit: usize, data: &[u8]) -> u64 {
    let room = limit.saturating_sub(kept.len());
    let take = data.len().min(room);
    kept.extend_from_slice(&data[..take]);
    (data.len() - take) as u64
}

/// How much of a directory listing a client keeps. The agent sends a directory of any size;
/// past either limit the client stops reading and returns what it kept, marked truncated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListLimits {
    /// Entries kept at most.
    pub max_entries: usize,
    /// Bytes the kept entries may take in memory at most (see [`entry_bytes`]).
    pub max_bytes: usize,
}

impl Default for ListLimits {
    /// 100,000 entries or 16 MiB: a listing an HTTP answer can carry in one piece.
    fn default() -> Self {
        ListLimits {
            max_entries: 100_000,
            max_bytes: 16 << 20,
        }
    }
}

/// What one kept entry costs in memory, as [`ListLimits::max_bytes`] counts it: the entry
/// itself and its name.
pub fn entry_bytes(entry: &DirEntry) -> usize {
    std::mem::size_of::<DirEntry>() + entry.name.len()
}

/// A directory listing as far as it was kept, from [`AgentClient::list_limited`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Listing {
    /// The entries kept, sorted by name.
    pub entries: Vec<DirEntry>,
    /// Entries the agent sent before the client stopped reading: all of them (and then
    /// checked against the agent's count) unless `truncated`.
    pub received: u64,
    /// The listing went past a limit: the client stopped reading, and `entries` is only the
    /// first part of the directory (in the agent's order, then sorted).
    pub truncated: bool,
}

fn agent_error(e: ErrorReply) -> Error {
    Error::Agent {
        code: e.code,
        message: e.error,
    }
}

fn unexpected(expected: &'static str, got: &Incoming) -> Error {
    Error::Protocol(ProtocolError::Unexpected {
        expected,
        got: got.frame_type(),
    })
}

/// A frame from the agent as the client takes it: an OK is kept as its JSON text and parsed
/// straight into the op's reply type (never into a `serde_json::Value`, whose tree can take
/// many times the frame's size); everything else is a [`Message`].
enum Incoming {
    Ok(Vec<u8>),
    Message(Message),
}

impl Incoming {
    fn frame_type(&self) -> FrameType {
        match self {
            Incoming::Ok(_) => FrameType::Ok,
            Incoming::Message(m) => m.frame_type(),
        }
    }
}

/// Parses an OK payload into the op's reply type.
fn parse_ok<T: DeserializeOwned>(payload: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(payload).map_err(|e| {
        Error::Protocol(ProtocolError::BadPayload {
            frame: FrameType::Ok,
            reason: e.to_string(),
        })
    })
}

/// A connection to the agent, good for one operation.
pub struct AgentClient<S> {
    stream: S,
    hello: Option<Hello>,
    shared: Option<(SharedWriter, Arc<ExecState>)>,
}

impl<S: Read + Write> AgentClient<S> {
    /// Wraps a connected stream. Nothing is read until the first call.
    pub fn new(stream: S) -> Self {
        AgentClient {
            stream,
            hello: None,
            shared: None,
        }
    }

    /// The stream back, e.g. to set timeouts on it.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// Reads the agent's HELLO (once; later calls return the same) and checks the
    /// protocol version. Every op calls it first, so calling it is optional.
    pub fn hello(&mut self) -> Result<&Hello, Error> {
        if self.hello.is_none() {
            let hello = match self.recv("the agent's HELLO")? {
                Incoming::Message(Message::Hello(h)) => h,
                Incoming::Message(Message::Error(e)) => return Err(agent_error(e)),
                other => return Err(unexpected("HELLO", &other)),
            };
            if hello.protocol != PROTOCOL_VERSION {
                return Err(Error::VersionMismatch {
                    ours: PROTOCOL_VERSION,
                    theirs: hello.protocol,
                    agent: hello.agent,
                });
            }
            self.hello = Some(hello);
        }
        self.hello
            .as_ref()
            .ok_or(Error::Protocol(ProtocolError::Closed("the agent's HELLO")))
    }

    fn recv(&mut self, waiting_for: &'static str) -> Result<Incoming, Error> {
        let frame = match read_frame(&mut self.stream)? {
            Some(frame) => frame,
            None => return Err(ProtocolError::Closed(waiting_for).into()),
        };
        match frame.kind {
            FrameType::Ok => Ok(Incoming::Ok(frame.payload)),
            FrameType::Hello if frame.payload.len() > MAX_HELLO => {
                Err(Error::Protocol(ProtocolError::Other(format!(
                    "a HELLO of {} bytes: this host accepts at most {MAX_HELLO}",
                    frame.payload.len()
                ))))
            }
            _ => Ok(Incoming::Message(Message::from_frame(frame)?)),
        }
    }

    fn send(&mut self, request: Request) -> Result<(), Error> {
        request.validate().map_err(Error::InvalidRequest)?;
        self.hello()?;
        write_message(&mut self.stream, &Message::Request(request))?;
        Ok(())
    }

    /// Reads the OK ending an op (or its ERROR).
    fn expect_ok<T: DeserializeOwned>(&mut self, waiting_for: &'static str) -> Result<T, Error> {
        match self.recv(waiting_for)? {
            Incoming::Ok(payload) => parse_ok(&payload),
            Incoming::Message(Message::Error(e)) => Err(agent_error(e)),
            other => Err(unexpected("OK or ERROR", &other)),
        }
    }

    fn simple<T: DeserializeOwned>(
        mut self,
        request: Request,
        waiting_for: &'static str,
    ) -> Result<T, Error> {
        self.send(request)?;
        self.expect_ok(waiting_for)
    }

    /// Writes `data` to `path` in the guest; returns the bytes written.
    pub fn write_file<R: Read>(
        mut self,
        path: &str,
        opts: &WriteFileOptions,
        mut data: R,
    ) -> Result<u64, Error> {
        self.send(Request::WriteFile(WriteFileRequest {
            path: path.to_owned(),
            mode: opts.mode,
            atomic: opts.atomic,
            mkdirs: opts.mkdirs,
        }))?;
        let mut buf = vec![0u8; CHUNK_SIZE];
        let mut sent = 0u64;
        loop {
            let n = read_some(&mut data, &mut buf).map_err(Error::Input)?;
            if let Err(e) = write_frame(&mut self.stream, FrameType::Data, &buf[..n]) {
                // The agent answers ERROR as soon as it fails (say, the directory is
                // missing) and then closes, which is why the write failed: report its reason.
                return Err(self.pending_error().unwrap_or_else(|| e.into()));
            }
            if n == 0 {
                break;
            }
            sent += n as u64;
        }
        let reply: WriteFileReply = self.expect_ok("write_file's OK")?;
        if reply.bytes != sent {
            return Err(ProtocolError::Other(format!(
                "the agent reports {} bytes written, {sent} were sent",
                reply.bytes
            ))
            .into());
        }
        Ok(reply.bytes)
    }

    fn pending_error(&mut self) -> Option<Error> {
        match self.recv("write_file's ERROR") {
            Ok(Incoming::Message(Message::Error(e))) => Some(agent_error(e)),
            _ => None,
        }
    }

    /// Copies the file at `path` in the guest into `out`; returns the bytes copied.
    pub fn read_file<W: Write>(mut self, path: &str, mut out: W) -> Result<u64, Error> {
        self.send(Request::ReadFile(ReadFileRequest {
            path: path.to_owned(),
        }))?;
        let _info: ReadFileReply = self.expect_ok("read_file's OK")?;
        let mut total = 0u64;
        loop {
            match self.recv("read_file's DATA")? {
                Incoming::Message(Message::Data(bytes)) if bytes.is_empty() => break,
                Incoming::Message(Message::Data(bytes)) => {
                    out.write_all(&bytes).map_err(Error::Output)?;
                    total += bytes.len() as u64;
                }
                Incoming::Message(Message::Error(e)) => return Err(agent_error(e)),
                other => return Err(unexpected("DATA or ERROR", &other)),
            }
        }
        out.flush().map_err(Error::Output)?;
        Ok(total)
    }

    /// Metadata of `path`; `follow` follows a final symlink.
    pub fn stat(self, path: &str, follow: bool) -> Result<StatReply, Error> {
        let request = Request::Stat(StatRequest {
            path: path.to_owned(),
            follow,
        });
        self.simple(request, "stat's OK")
    }

    /// The entries of directory `path`, sorted by name. A directory past
    /// [`ListLimits::default`] is [`Error::TooLarge`]: [`AgentClient::list_limited`] keeps
    /// the first part of it.
    pub fn list(self, path: &str) -> Result<Vec<DirEntry>, Error> {
        let limits = ListLimits::default();
        let listing = self.list_limited(path, limits)?;
        if listing.truncated {
            return Err(Error::TooLarge {
                what: "directory listing",
                limit: format!(
                    "{} entries or {} bytes",
                    limits.max_entries, limits.max_bytes
                ),
                advice: "list_limited keeps the first part of it",
            });
        }
        Ok(listing.entries)
    }

    /// The entries of directory `path`, sorted by name, as far as `limits` keep them: past
    /// either limit the client stops reading (the connection is then of no more use) and the
    /// listing is marked truncated. Memory stays within the limits plus one frame, whatever
    /// the agent sends.
    pub fn list_limited(mut self, path: &str, limits: ListLimits) -> Result<Listing, Error> {
        self.send(Request::List(ListRequest {
            path: path.to_owned(),
        }))?;
        let mut listing = Listing::default();
        let mut bytes = 0usize;
        loop {
            match self.recv("list's ENTRIES or OK")? {
                Incoming::Message(Message::Entries(batch)) => {
                    listing.received += batch.len() as u64;
                    for entry in batch {
                        let size = entry_bytes(&entry);
                        if listing.entries.len() >= limits.max_entries
                            || bytes.saturating_add(size) > limits.max_bytes
                        {
                            listing.truncated = true;
                            break;
                        }
                        bytes += size;
                        listing.entries.push(entry);
                    }
                    if listing.truncated {
                        break;
                    }
                }
                Incoming::Ok(payload) => {
                    let reply: ListReply = parse_ok(&payload)?;
                    if reply.count != listing.received {
                        return Err(ProtocolError::Other(format!(
                            "the agent counted {} entries but sent {}",
                            reply.count, listing.received
                        ))
                        .into());
                    }
                    break;
                }
                Incoming::Message(Message::Error(e)) => return Err(agent_error(e)),
                other => return Err(unexpected("ENTRIES, OK or ERROR", &other)),
            }
        }
        listing.entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(listing)
    }

    /// Removes `path`; a directory with contents only if `recursive`.
    pub fn remove(self, path: &str, recursive: bool) -> Result<(), Error> {
        let request = Request::Remove(RemoveRequest {
            path: path.to_owned(),
            recursive,
        });
        self.simple::<Empty>(request, "remove's OK").map(drop)
    }

    /// Creates directory `path` with permission bits `mode`; `parents` as `mkdir -p`.
    pub fn mkdir(self, path: &str, mode: u32, parents: bool) -> Result<(), Error> {
        let request = Request::Mkdir(MkdirRequest {
            path: path.to_owned(),
            mode,
            parents,
        });
        self.simple::<Empty>(request, "mkdir's OK").map(drop)
    }

    /// Tells the guest it was restored or forked: clock, entropy, hostname, identity, hooks.
    pub fn refresh(self, request: &RefreshRequest) -> Result<RefreshReply, Error> {
        self.simple(Request::Refresh(request.clone()), "refresh's OK")
    }

    /// The identity the last refresh set.
    pub fn identity(self) -> Result<Identity, Error> {
        self.simple(Request::Identity(NoFields {}), "identity's OK")
    }

    pub fn ping(self) -> Result<PingReply, Error> {
        self.simple(Request::Ping(NoFields {}), "ping's OK")
    }
}

impl<S: Duplex> AgentClient<S> {
    fn shared(&mut self) -> Result<(SharedWriter, Arc<ExecState>), Error> {
        if let Some((writer, state)) = &self.shared {
            return Ok((writer.clone(), state.clone()));
        }
        let clone = self.stream.try_clone_stream().map_err(Error::Io)?;
        let writer: SharedWriter = Arc::new(Mutex::new(Box::new(clone)));
        let state = Arc::new(ExecState::default());
        self.shared = Some((writer.clone(), state.clone()));
        Ok((writer, state))
    }

    /// A handle to signal the program the coming [`AgentClient::exec`] runs.
    pub fn signaller(&mut self) -> Result<Signaller, Error> {
        let (writer, state) = self.shared()?;
        Ok(Signaller { writer, state })
    }

    /// Runs a program. Output arrives through `on_stdout` and `on_stderr` as it is written
    /// (in chunks of at most 64 KiB); returns how the program ended.
    ///
    /// With `stdin` given, a thread copies it to the program (the request's `stdin` is set to
    /// `"stream"`; without, to `"none"`). When the program exits first, the thread is left to
    /// end on its own at its next read: a reader that blocks forever keeps that thread.
    /// A program that could not be started is an `Ok` record with exit code 127 or 126
    /// and `error` set.
    pub fn exec<R, O, E>(
        mut self,
        request: &ExecRequest,
        stdin: Option<R>,
        mut on_stdout: O,
        mut on_stderr: E,
    ) -> Result<ExitRecord, Error>
    where
        R: Read + Send + 'static,
        O: FnMut(&[u8]),
        E: FnMut(&[u8]),
    {
        let mut request = request.clone();
        request.stdin = match stdin {
            Some(_) => StdinMode::Stream,
            None => StdinMode::None,
        };
        let (writer, state) = self.shared()?;
        self.send(Request::Exec(request))?;
        let pump = match stdin {
            Some(input) => Some(
                thread::Builder::new()
                    .name("mayfly-exec-stdin".into())
                    .spawn(move || pump_stdin(input, &writer))
                    .map_err(Error::Io)?,
            ),
            None => None,
        };
        let result = self.exec_frames(&state, &mut on_stdout, &mut on_stderr);
        state.phase.store(DONE, Ordering::Release);
        // The operation is over either way: shutting the connection ends the agent's side
        // and fails any write the stdin thread is blocked in.
        let _ = self.stream.shutdown_stream();
        let input_error = match pump {
            Some(handle) if handle.is_finished() => match handle.join() {
                Ok(result) => result.err(),
                Err(_) => None,
            },
            _ => None,
        };
        let exit = result?;
        match input_error {
            Some(e) => Err(Error::Input(e)),
            None => Ok(exit),
        }
    }

    fn exec_frames(
        &mut self,
        state: &ExecState,
        on_stdout: &mut dyn FnMut(&[u8]),
        on_stderr: &mut dyn FnMut(&[u8]),
    ) -> Result<ExitRecord, Error> {
        let mut started = false;
        loop {
            let message = match self.recv("the program's EXIT")? {
                Incoming::Message(message) => message,
                other => {
                    let expected = if started {
                        "STDOUT, STDERR, EXIT or ERROR"
                    } else {
                        "STARTED, EXIT or ERROR"
                    };
                    return Err(unexpected(expected, &other));
                }
            };
            match message {
                Message::Started(s) if !started => {
                    started = true;
                    state.pid.store(s.pid, Ordering::Release);
                    state.phase.store(RUNNING, Ordering::Release);
                }
                Message::Stdout(bytes) if started => on_stdout(&bytes),
                Message::Stderr(bytes) if started => on_stderr(&bytes),
                Message::Exit(exit) => return Ok(exit),
                Message::Error(e) => return Err(agent_error(e)),
                other if started => {
                    return Err(unexpected(
                        "STDOUT, STDERR, EXIT or ERROR",
                        &Incoming::Message(other),
                    ))
                }
                other => {
                    return Err(unexpected(
                        "STARTED, EXIT or ERROR",
                        &Incoming::Message(other),
                    ))
                }
            }
        }
    }

    /// [`AgentClient::exec`], collecting up to [`DEFAULT_OUTPUT_LIMIT`] bytes of each output
    /// stream in memory (the rest is counted).
    pub fn exec_output(
        self,
        request: &ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<ExecOutput, Error> {
        self.exec_output_limited(request, stdin, DEFAULT_OUTPUT_LIMIT)
    }

    /// [`AgentClient::exec`], collecting up to `limit` bytes of each output stream in memory;
    /// what does not fit is counted in `stdout_dropped` / `stderr_dropped`, not kept.
    pub fn exec_output_limited(
        self,
        request: &ExecRequest,
        stdin: Option<Vec<u8>>,
        limit: usize,
    ) -> Result<ExecOutput, Error> {
        let mut out = ExecOutput::default();
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let (mut stdout_dropped, mut stderr_dropped) = (0u64, 0u64);
        out.exit = self.exec(
            request,
            stdin.map(Cursor::new),
            |b| stdout_dropped += keep_bounded(&mut stdout, limit, b),
            |b| stderr_dropped += keep_bounded(&mut stderr, limit, b),
        )?;
        out.stdout = stdout;
        out.stderr = stderr;
        out.stdout_dropped = stdout_dropped;
        out.stderr_dropped = stderr_dropped;
        Ok(out)
    }
}

fn read_some<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match r.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Copies `input` into STDIN frames, ending with an empty one. Returns only errors of the
/// input: a failed write means the connection ended, which the reading side reports.
fn pump_stdin<R: Read>(mut input: R, writer: &SharedWriter) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK_SIZE];
    loop {
        let n = match read_some(&mut input, &mut buf) {
            Ok(n) => n,
            Err(e) => {
                // End the program's input rather than leave it waiting for more.
                if let Ok(frame) = crate::frame::encode_frame(FrameType::Stdin, &[]) {
                    let _ = write_shared(writer, &frame);
                }
                return Err(e);
            }
        };
        // A chunk always fits in a frame; should that ever change, stop rather than panic.
        let Ok(frame) = crate::frame::encode_frame(FrameType::Stdin, &buf[..n]) else {
            return Ok(());
        };
        if write_shared(writer, &frame).is_err() || n == 0 {
            return Ok(());
        }
    }
}
