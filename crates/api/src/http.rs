//! Just enough HTTP/1.1 for the control socket: read one request under size and time limits,
//! encode one response and, for the client, read one response; a chunked response body for
//! answers that stream, and a request body read as it streams in. No keep-alive and no chunked
//! request bodies: every response closes its connection. Heads (request and status lines,
//! headers) are parsed by httparse; what is mayfly's own is the I/O around it: every read under
//! an idle timeout and a deadline, and the limits on what a peer may make it hold.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// The largest request head (request line and headers) the server reads.
pub const MAX_HEAD: usize = 16 * 1024;
/// The largest request body the server reads.
pub const MAX_BODY: usize = 64 * 1024;
/// The largest response head and body the client reads.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;
const MAX_RESPONSE_BODY: u64 = 64 << 20;

/// The instant `after` from now; absurdly long timeouts saturate instead of overflowing.
pub fn deadline(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Why reading from a peer stopped.
#[derive(Debug)]
pub enum ReadError {
    /// The peer closed its side.
    Eof,
    /// Nothing arrived within the per-read timeout, or the overall deadline passed.
    TimedOut,
    Io(io::Error),
}

#[derive(Debug)]
enum HeadError {
    TooLarge,
    Read(ReadError),
    /// httparse refused it.
    Invalid(httparse::Error),
}

/// Headers a message may have at most (more: 431, as for a head too large).
const MAX_HEADERS: usize = 64;

/// A request head, parsed (httparse) and copied out of the buffer.
struct RequestHead {
    method: String,
    target: String,
    minor: u8,
    headers: Vec<(String, Vec<u8>)>,
}

fn parse_request_head(buf: &[u8]) -> Result<Option<(usize, RequestHead)>, httparse::Error> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    Ok(match request.parse(buf)? {
        httparse::Status::Partial => None,
        httparse::Status::Complete(end) => Some((
            end,
            RequestHead {
                method: request.method.unwrap_or_default().to_owned(),
                target: request.path.unwrap_or_default().to_owned(),
                minor: request.version.unwrap_or(1),
                headers: request
                    .headers
                    .iter()
                    .map(|h| (h.name.to_owned(), h.value.trim_ascii().to_vec()))
                    .collect(),
            },
        )),
    })
}

/// A response head, parsed (httparse).
struct ResponseHead {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
}

fn parse_response_head(buf: &[u8]) -> Result<Option<(usize, ResponseHead)>, httparse::Error> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    Ok(match response.parse(buf)? {
        httparse::Status::Partial => None,
        httparse::Status::Complete(end) => Some((
            end,
            ResponseHead {
                status: response.code.unwrap_or(0),
                headers: response
                    .headers
                    .iter()
                    .map(|h| (h.name.to_owned(), h.value.trim_ascii().to_vec()))
                    .collect(),
            },
        )),
    })
}

/// Buffered reads from a stream, each bounded by an idle timeout and an overall deadline.
struct Reader<'a> {
    stream: &'a UnixStream,
    idle: Duration,
    deadline: Instant,
    buf: Vec<u8>,
    received: usize,
}

impl<'a> Reader<'a> {
    fn new(stream: &'a UnixStream, idle: Duration, deadline: Instant) -> Self {
        Self {
            stream,
            idle,
            deadline,
            buf: Vec::new(),
            received: 0,
        }
    }

    /// Append at least one more byte from the stream to the buffer.
    fn fill(&mut self) -> Result<(), ReadError> {
        let wait = self
            .deadline
            .saturating_duration_since(Instant::now())
            .min(self.idle);
        if wait.is_zero() {
            return Err(ReadError::TimedOut);
        }
        self.stream
            .set_read_timeout(Some(wait))
            .map_err(ReadError::Io)?;
        let mut chunk = [0u8; 4096];
        loop {
            match (&mut &*self.stream).read(&mut chunk) {
                Ok(0) => return Err(ReadError::Eof),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    self.received += n;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(ReadError::TimedOut)
                }
                Err(e) => return Err(ReadError::Io(e)),
            }
        }
    }

    /// Read a message head, `max` bytes at most, and parse it with `parse` (httparse), which
    /// says how long the head is once it is all there. Whatever followed it stays buffered.
    /// Blank lines before the head are skipped, as RFC 9112 asks of servers.
    fn read_head<T>(
        &mut self,
        max: usize,
        parse: impl Fn(&[u8]) -> Result<Option<(usize, T)>, httparse::Error>,
    ) -> Result<T, HeadError> {
        let mut skipped = 0;
        loop {
            loop {
                let blank = if self.buf.starts_with(b"\r\n") {
                    2
                } else if self.buf.starts_with(b"\n") {
                    1
                } else {
                    break;
                };
                self.buf.drain(..blank);
                skipped += blank;
            }
            match parse(&self.buf) {
                Ok(Some((end, head))) => {
                    if skipped + end > max {
                        return Err(HeadError::TooLarge);
                    }
                    self.buf.drain(..end);
                    return Ok(head);
                }
                Ok(None) => {}
                Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
                Err(e) => return Err(HeadError::Invalid(e)),
            }
            if skipped + self.buf.len() > max {
                return Err(HeadError::TooLarge);
            }
            self.fill().map_err(HeadError::Read)?;
        }
    }

    /// Read exactly `len` more bytes (some may already be buffered).
    fn read_body(&mut self, len: usize) -> Result<Vec<u8>, ReadError> {
        while self.buf.len() < len {
            self.fill()?;
        }
        let rest = self.buf.split_off(len);
        Ok(std::mem::replace(&mut self.buf, rest))
    }

    /// Read until the peer closes, `max` bytes at most.
    fn read_to_end(&mut self, max: u64) -> Result<Vec<u8>, ReadError> {
        loop {
            if self.buf.len() as u64 > max {
                return Err(ReadError::Io(io::Error::other(
                    "the response body is too large",
                )));
            }
            match self.fill() {
                Ok(()) => {}
                Err(ReadError::Eof) => return Ok(std::mem::take(&mut self.buf)),
                // A Unix socket closed with unread data resets its peer after the last byte.
                Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset => {
                    return Ok(std::mem::take(&mut self.buf))
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// A token character (RFC 9110 5.6.2): what method and header names are made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Whether `s` is a token (a method the client may send).
pub fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(is_tchar)
}

/// Bytes from a peer, quoted and cut short, for an error message.
fn shown(bytes: &[u8]) -> String {
    const MAX: usize = 80;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX)]);
    if bytes.len() > MAX {
        format!("{text:?}...")
    } else {
        format!("{text:?}")
    }
}

/// Parse a Content-Length value: digits only. Values too large for u64 become u64::MAX, which
/// is over every limit anyway.
fn parse_content_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        value
            .iter()
            .try_fold(0u64, |n, &d| {
                n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
            })
            .unwrap_or(u64::MAX),
    )
}

/// A request the server accepts at the HTTP level; routing comes next.
#[derive(Debug, PartialEq)]
pub struct Request {
    pub method: String,
    /// The target's path: no query or fragment, no trailing slash (but "/" stays).
    pub path: String,
    /// The target's query, without the `?` (still percent-encoded).
    pub query: String,
    pub body: Vec<u8>,
    /// For a request whose body is streamed rather than read here (see [`read_request`]):
    /// its length, of which `body` holds what arrived with the head.
    pub streamed_body_len: Option<u64>,
    /// The `Authorization` header's value, if the request had one (`mayfly serve` checks
    /// it; a VMM's own socket ignores it).
    pub authorization: Option<String>,
}

/// Why the server will not route a request.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    /// Nothing to answer: the peer sent nothing and left, or the connection broke.
    Silent,
    /// Answer with this status and `{"error": message}`.
    Reply { status: u16, message: String },
}

fn refuse(status: u16, message: impl Into<String>) -> Refusal {
    Refusal::Reply {
        status,
        message: message.into(),
    }
}

fn timed_out(idle: Duration, total: Duration) -> Refusal {
    refuse(
        408,
        format!(
            "the request did not arrive in time (mayfly waits {} s for each piece and {} s for \
             the whole request): send it all at once",
            idle.as_secs_f64(),
            total.as_secs_f64()
        ),
    )
}

/// Read one request from `stream`. Nothing may pause for longer than `idle`, and the whole
/// request must have arrived within `total`. The body of requests that `streamed(method,
/// path)` picks is left unread past what arrived with the head: its reader streams it (a file
/// upload), of any size; `streamed_body_len` says how long it is.
pub fn read_request(
    stream: &UnixStream,
    idle: Duration,
    total: Duration,
    streamed: impl Fn(&str, &str) -> bool,
) -> Result<Request, Refusal> {
    let mut reader = Reader::new(stream, idle, deadline(total));
    let head = match reader.read_head(MAX_HEAD, parse_request_head) {
        Ok(head) => head,
        Err(HeadError::TooLarge) => {
            return Err(refuse(
                431,
                format!(
                    "the request line and headers are larger than {} KiB (or more than \
                     {MAX_HEADERS} headers)",
                    MAX_HEAD >> 10
                ),
            ))
        }
        Err(HeadError::Invalid(e)) => return Err(malformed(&reader.buf, e)),
        Err(HeadError::Read(ReadError::Eof)) if reader.received == 0 => {
            return Err(Refusal::Silent)
        }
        Err(HeadError::Read(ReadError::Eof)) => {
            return Err(refuse(
                400,
                "the connection closed in the middle of the request line or headers",
            ))
        }
        Err(HeadError::Read(ReadError::TimedOut)) => return Err(timed_out(idle, total)),
        Err(HeadError::Read(ReadError::Io(_))) => return Err(Refusal::Silent),
    };
    let (method, target, minor) = (head.method.as_str(), head.target.as_str(), head.minor);
    check_target(target)?;
    let header_lines = &head.headers;

    let mut content_length = None;
    let mut transfer_encoding = None;
    let mut expect_continue = false;
    let mut authorization = None;
    for (name, value) in header_lines {
        let (name, value) = (name.as_str(), value.as_slice());
        if name.eq_ignore_ascii_case("content-length") {
            let len = parse_content_length(value).ok_or_else(|| {
                refuse(
                    400,
                    format!(
                        "invalid Content-Length {}: expected a number of bytes",
                        shown(value)
                    ),
                )
            })?;
            if content_length.is_some_and(|previous| previous != len) {
                return Err(refuse(
                    400,
                    "the request has conflicting Content-Length headers",
                ));
            }
            content_length = Some(len);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            transfer_encoding = Some(String::from_utf8_lossy(value).into_owned());
        } else if name.eq_ignore_ascii_case("expect") {
            if !value.eq_ignore_ascii_case(b"100-continue") {
                return Err(refuse(
                    417,
                    format!(
                        "unsupported Expect: {}; mayfly only knows 100-continue",
                        shown(value)
                    ),
                ));
            }
            expect_continue = true;
        } else if name.eq_ignore_ascii_case("authorization") {
            authorization = Some(String::from_utf8_lossy(value).into_owned());
        }
    }
    if let Some(coding) = transfer_encoding {
        return Err(refuse(
            411,
            format!(
                "Transfer-Encoding ({coding}) is not supported: send the body with a \
                 Content-Length header instead (curl does with -d or --data-binary)"
            ),
        ));
    }
    let len = content_length.unwrap_or(0);
    let path = normalize_path(target);
    if streamed(method, &path) {
        if expect_continue && minor == 1 {
            let _ = (&mut &*stream).write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        let mut prefix = std::mem::take(&mut reader.buf);
        prefix.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        return Ok(Request {
            method: method.to_owned(),
            path,
            query: query_of(target),
            body: prefix,
            streamed_body_len: Some(len),
            authorization,
        });
    }
    if len > MAX_BODY as u64 {
        return Err(refuse(
            413,
            format!(
                "the body is {len} bytes; mayfly accepts at most {MAX_BODY} bytes ({} KiB)",
                MAX_BODY >> 10
            ),
        ));
    }
    // At most MAX_BODY (checked above).
    let len = usize::try_from(len).expect("a body within MAX_BODY");
    if expect_continue && minor == 1 && reader.buf.len() < len {
        // The client waits for this before it sends the body; if the write fails, so will
        // reading the body.
        let _ = (&mut &*stream).write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
    }
    let body = match reader.read_body(len) {
        Ok(body) => body,
        Err(ReadError::Eof) => {
            return Err(refuse(
                400,
                format!(
                    "the body ended after {} of the {len} bytes its Content-Length announced",
                    reader.buf.len()
                ),
            ))
        }
        Err(ReadError::TimedOut) => return Err(timed_out(idle, total)),
        Err(ReadError::Io(_)) => return Err(Refusal::Silent),
    };
    Ok(Request {
        method: method.to_owned(),
        path,
        query: query_of(target),
        body,
        streamed_body_len: None,
        authorization,
    })
}

/// The query of a request target (after `?`, before `#`).
fn query_of(target: &str) -> String {
    match target.split_once('?') {
        Some((_, rest)) => rest.split('#').next().unwrap_or("").to_owned(),
        None => String::new(),
    }
}

/// The value of `key` in a query string, percent-decoded (`+` is a space); None if absent or
/// not valid UTF-8 once decoded.
pub fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k)? == key)
            .then(|| percent_decode(v))
            .flatten()
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes.get(i + 1..i + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Split `METHOD TARGET HTTP/1.x` into its parts; the minor version is 0 or 1.
/// Why httparse refused a request head, as an answer: 505 for a version that is HTTP but not
/// 1.x, 400 with what was wrong for everything else.
fn malformed(buf: &[u8], e: httparse::Error) -> Refusal {
    let line_end = buf.iter().position(|&b| b == b'\n').unwrap_or(buf.len());
    let line = buf[..line_end]
        .strip_suffix(b"\r")
        .unwrap_or(&buf[..line_end]);
    if e == httparse::Error::Version {
        let text = String::from_utf8_lossy(line);
        let version = text.split(' ').nth(2).unwrap_or("");
        let numbered = text.split(' ').count() == 3
            && version.strip_prefix("HTTP/").is_some_and(|v| {
                let v = v.as_bytes();
                v.len() == 3 && v[0].is_ascii_digit() && v[1] == b'.' && v[2].is_ascii_digit()
            });
        if numbered {
            return refuse(
                505,
                format!("{version} is not supported: use HTTP/1.1 (or HTTP/1.0)"),
            );
        }
    }
    refuse(
        400,
        format!(
            "malformed request ({e}) at or after the line {}: expected METHOD /path HTTP/1.1, e.g. \
             GET /vm HTTP/1.1, then Name: value headers",
            shown(line)
        ),
    )
}

/// The request target must be a path (or an absolute URI, whose path is taken).
fn check_target(target: &str) -> Result<(), Refusal> {
    let absolute = ["http://", "https://"].iter().any(|scheme| {
        target
            .get(..scheme.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(scheme))
    });
    if target.starts_with('/') || absolute {
        Ok(())
    } else {
        Err(refuse(
            400,
            format!(
                "the request target {} is not a path: expected one such as /vm",
                shown(target.as_bytes())
            ),
        ))
    }
}

/// The path of a request target: the scheme and authority of an absolute URI, the query,
/// the fragment and any trailing slashes go.
fn normalize_path(target: &str) -> String {
    let mut path = target;
    if let Some(scheme_end) = path.find("://").filter(|_| !path.starts_with('/')) {
        let after = &path[scheme_end + 3..];
        path = after.find('/').map_or("/", |slash| &after[slash..]);
    }
    if let Some(end) = path.find(['?', '#']) {
        path = &path[..end];
    }
    let trimmed = path.trim_end_matches('/');
    if trimmed.is_empty() {
        "/".to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// The reason phrase of a status code.
pub fn reason(status: u16) -> &'static str {
    let known = match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        417 => "Expectation Failed",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "",
    };
    match (known, status / 100) {
        ("", 2) => "Success",
        ("", 3) => "Redirection",
        ("", 4) => "Client Error",
        ("", _) => "Server Error",
        (known, _) => known,
    }
}

/// The bytes of a complete response. A 204 has no body and no Content-Length; any other
/// response says how long its body is, and every one closes the connection.
pub fn encode_response(
    status: u16,
    body: Option<&serde_json::Value>,
    extra_headers: &[(&str, &str)],
) -> Vec<u8> {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in extra_headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = match body {
        Some(value) if status != 204 => {
            let mut bytes = serde_json::to_vec(value).unwrap_or_else(|_| b"null".to_vec());
            bytes.push(b'\n');
            head.push_str("Content-Type: application/json\r\n");
            bytes
        }
        _ => Vec::new(),
    };
    if status != 204 {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("Connection: close\r\n\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(&body);
    out
}

/// A response as the client reads it.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Why the client could not read a response.
#[derive(Debug)]
pub enum ResponseError {
    Read(ReadError),
    /// The server closed the connection before it sent anything.
    NoResponse,
    Invalid(String),
}

/// Read one response from `stream` (skipping any 1xx interim ones) before `deadline`.
pub fn read_response(stream: &UnixStream, deadline: Instant) -> Result<Response, ResponseError> {
    let idle = deadline.saturating_duration_since(Instant::now());
    let mut reader = Reader::new(stream, idle, deadline);
    loop {
        let head = match reader.read_head(MAX_RESPONSE_HEAD, parse_response_head) {
            Ok(head) => head,
            Err(HeadError::TooLarge) => {
                return Err(ResponseError::Invalid(format!(
                    "its headers are larger than {} KiB",
                    MAX_RESPONSE_HEAD >> 10
                )))
            }
            Err(HeadError::Invalid(e)) => {
                return Err(ResponseError::Invalid(format!(
                    "malformed response head: {e}"
                )))
            }
            Err(HeadError::Read(ReadError::Eof)) if reader.buf.is_empty() => {
                return Err(ResponseError::NoResponse)
            }
            Err(HeadError::Read(ReadError::Eof)) => {
                return Err(ResponseError::Invalid(
                    "it closed the connection in the middle of the headers".into(),
                ))
            }
            Err(HeadError::Read(e)) => return Err(ResponseError::Read(e)),
        };
        let status = head.status;
        if !(100..=999).contains(&status) {
            return Err(ResponseError::Invalid(format!(
                "malformed status code {status}"
            )));
        }
        let mut content_length = None;
        for (name, value) in &head.headers {
            if name.eq_ignore_ascii_case("content-length") {
                content_length = Some(parse_content_length(value).ok_or_else(|| {
                    ResponseError::Invalid(format!("invalid Content-Length {}", shown(value)))
                })?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                return Err(ResponseError::Invalid(
                    "it uses a Transfer-Encoding, which this client does not read".into(),
                ));
            }
        }
        if (100..200).contains(&status) {
            continue;
        }
        let body = match content_length {
            _ if status == 204 || status == 304 => Vec::new(),
            Some(len) if len > MAX_RESPONSE_BODY => {
                return Err(ResponseError::Invalid(format!(
                    "its body is {len} bytes, more than the {} MiB this client reads",
                    MAX_RESPONSE_BODY >> 20
                )))
            }
            // At most MAX_RESPONSE_BODY (the arm above).
            Some(len) => reader
                .read_body(usize::try_from(len).expect("a body within MAX_RESPONSE_BODY"))
                .map_err(|e| match e {
                    ReadError::Eof => ResponseError::Invalid(
                        "it closed the connection in the middle of the body".into(),
                    ),
                    e => ResponseError::Read(e),
                })?,
            None => reader
                .read_to_end(MAX_RESPONSE_BODY)
                .map_err(ResponseError::Read)?,
        };
        return Ok(Response { status, body });
    }
}

/// A chunked HTTP response body.
pub struct Chunked<'a> {
    stream: &'a UnixStream,
    /// A write to the client failed: the rest is not sent.
    pub failed: bool,
}

impl<'a> Chunked<'a> {
    pub fn start(stream: &'a UnixStream, content_type: &str) -> io::Result<Self> {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        (&mut &*stream).write_all(head.as_bytes())?;
        Ok(Self {
            stream,
            failed: false,
        })
    }

    pub fn chunk(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut out = format!("{:x}\r\n", data.len()).into_bytes();
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
        let result = (&mut &*self.stream).write_all(&out);
        if result.is_err() {
            self.failed = true;
        }
        result
    }

    pub fn line(&mut self, value: &serde_json::Value) -> io::Result<()> {
        let mut bytes = serde_json::to_vec(value).unwrap_or_default();
        bytes.push(b'\n');
        self.chunk(&bytes)
    }

    /// The last chunk: without it the client knows the body is incomplete.
    pub fn finish(self) -> io::Result<()> {
        (&mut &*self.stream).write_all(b"0\r\n\r\n")
    }
}

impl Write for Chunked<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.chunk(buf).map(|()| buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The rest of a streamed request body: what came with the head, then the socket, exactly
/// `len` bytes. A client that stops early or stalls is an error, never a short file.
pub struct StreamedBody<'a> {
    pub prefix: io::Cursor<Vec<u8>>,
    pub stream: &'a UnixStream,
    pub left: u64,
}

impl Read for StreamedBody<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = match self.prefix.read(&mut buf[..want])? {
            0 => (&mut &*self.stream).read(&mut buf[..want])?,
            n => n,
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the client sent {} bytes fewer than its Content-Length",
                    self.left
                ),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parse `bytes` as the server would, with the writing side closed.
    fn parse(bytes: &[u8]) -> Result<Request, Refusal> {
        let (mut client, server) = UnixStream::pair().unwrap();
        client.write_all(bytes).unwrap();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        read_request(
            &server,
            Duration::from_secs(2),
            Duration::from_secs(2),
            |_, _| false,
        )
    }

    fn status(result: Result<Request, Refusal>) -> u16 {
        match result {
            Ok(_) => 200,
            Err(Refusal::Silent) => 0,
            Err(Refusal::Reply { status, .. }) => status,
        }
    }

    #[test]
    fn parses_a_request() {
        let req =
            parse(b"PUT /vm/fork/?x=1 HTTP/1.1\r\nHost: x\r\ncontent-LENGTH: 4\r\nAuthorization: Bearer t\r\n\r\nabcdEXTRA")
                .unwrap();
        assert_eq!(
            req,
            Request {
                method: "PUT".into(),
                path: "/vm/fork".into(),
                query: "x=1".into(),
                body: b"abcd".to_vec(),
                streamed_body_len: None,
                authorization: Some("Bearer t".into()),
            }
        );
        assert_eq!(
            query_param("path=%2Ftmp%2Fa+b&mode=0644", "path").as_deref(),
            Some("/tmp/a b")
        );
        assert_eq!(
            query_param("path=%2Ftmp&mode=0644", "mode").as_deref(),
            Some("0644")
        );
        assert_eq!(query_param("path=%zz", "path"), None);
        assert_eq!(query_param("", "path"), None);
        let req = parse(b"\r\nGET http://localhost/vm HTTP/1.0\n\n").unwrap();
        assert_eq!(req.path, "/vm");
        assert!(req.body.is_empty());
        assert_eq!(
            parse(b"GET http://localhost HTTP/1.1\r\n\r\n")
                .unwrap()
                .path,
            "/"
        );
    }

    #[test]
    fn refuses_bad_requests() {
        assert_eq!(status(parse(b"")), 0);
        assert_eq!(status(parse(b"GET /vm HTTP/1.1\r\n")), 400);
        assert_eq!(status(parse(b"GET /vm\r\n\r\n")), 400);
        assert_eq!(status(parse(b"GET  /vm HTTP/1.1\r\n\r\n")), 400);
        assert_eq!(status(parse(b"GET vm HTTP/1.1\r\n\r\n")), 400);
        assert_eq!(status(parse(b"G(T /vm HTTP/1.1\r\n\r\n")), 400);
        assert_eq!(status(parse(b"GET /vm HTTP/2.0\r\n\r\n")), 505);
        assert_eq!(status(parse(b"GET /vm HTTP/1.1\r\nNoColon\r\n\r\n")), 400);
        assert_eq!(status(parse(b"GET /vm HTTP/1.1\r\nA : b\r\n\r\n")), 400);
        assert_eq!(
            status(parse(b"GET /vm HTTP/1.1\r\nA: b\r\n c\r\n\r\n")),
            400
        );
        assert_eq!(status(parse(b"GET /vm HTTP/1.1\r\nA: b\rc\r\n\r\n")), 400);
        assert_eq!(status(parse(b"GET /\xff HTTP/1.1\r\n\r\n")), 400);
        assert_eq!(
            status(parse(b"PUT /vm HTTP/1.1\r\nContent-Length: -1\r\n\r\n")),
            400
        );
        assert_eq!(
            status(parse(
                b"PUT /vm HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"
            )),
            400
        );
        assert_eq!(
            status(parse(b"PUT /vm HTTP/1.1\r\nContent-Length: 5\r\n\r\nab")),
            400
        );
        assert_eq!(
            status(parse(
                b"PUT /vm HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n"
            )),
            413
        );
        assert_eq!(
            status(parse(
                b"PUT /vm HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            )),
            411
        );
        assert_eq!(
            status(parse(b"PUT /vm HTTP/1.1\r\nExpect: magic\r\n\r\n")),
            417
        );
        let mut big = b"GET /vm HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD + 10, b'a');
        big.extend_from_slice(b"\r\n\r\n");
        assert_eq!(status(parse(&big)), 431);
    }

    #[test]
    fn idle_peer_times_out() {
        let (_client, server) = UnixStream::pair().unwrap();
        let started = Instant::now();
        let result = read_request(
            &server,
            Duration::from_millis(50),
            Duration::from_secs(5),
            |_, _| false,
        );
        assert_eq!(status(result), 408);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn encodes_responses() {
        let body = serde_json::json!({"a": 1});
        let bytes = encode_response(200, Some(&body), &[]);
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\
             Connection: close\r\n\r\n{\"a\":1}\n"
        );
        let bytes = encode_response(204, Some(&body), &[("Allow", "GET")]);
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            "HTTP/1.1 204 No Content\r\nAllow: GET\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn reads_responses() {
        let read = |bytes: &[u8]| {
            let (mut server, client) = UnixStream::pair().unwrap();
            server.write_all(bytes).unwrap();
            drop(server);
            read_response(&client, Instant::now() + Duration::from_secs(2))
        };
        let r =
            read(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}xx")
                .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        let r = read(b"HTTP/1.0 404 Not Found\r\n\r\n[1]").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, &b"[1]"[..]));
        assert!(matches!(read(b""), Err(ResponseError::NoResponse)));
        assert!(matches!(
            read(b"HTTP/1.1 2000 OK\r\n\r\n"),
            Err(ResponseError::Invalid(_))
        ));
        assert!(matches!(
            read(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}"),
            Err(ResponseError::Invalid(_))
        ));
        assert_eq!(read(b"HTTP/1.1 204\r\n\r\n").unwrap().status, 204);
        assert!(matches!(
            read(b"HTTP/1.1 20\r\n\r\n"),
            Err(ResponseError::Invalid(_))
        ));
    }
}
