//! A hand-written HTTP/2 caller for the tests that need what no well-behaved
//! client library sends: floods of control frames, silence after the preface,
//! a look at the exact frames (and flags) the sidecar sends back.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const PRIORITY: u8 = 0x2;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const END_STREAM: u8 = 0x1;
pub const ENHANCE_YOUR_CALM: u32 = 0xb;

/// One frame on the wire.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.push(kind);
    f.push(flags);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// A frame read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A GOAWAY's error code.
    pub fn goaway_code(&self) -> Option<u32> {
        (self.kind == GOAWAY && self.payload.len() >= 8).then(|| {
            u32::from_be_bytes([
                self.payload[4],
                self.payload[5],
                self.payload[6],
                self.payload[7],
            ])
        })
    }
}

/// A raw connection to the request plane.
pub struct RawH2 {
    pub stream: TcpStream,
}

/// The client preface and a SETTINGS frame of these `(identifier, value)`s.
pub fn preface(settings: &[(u16, u32)]) -> Vec<u8> {
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    let payload: Vec<u8> = settings
        .iter()
        .flat_map(|(id, value)| id.to_be_bytes().into_iter().chain(value.to_be_bytes()))
        .collect();
    hello.extend(frame(SETTINGS, 0, 0, &payload));
    hello
}

/// A whole unary-request call on `stream`: HEADERS (`block`, END_HEADERS)
/// and one DATA frame carrying `message` as a gRPC message, END_STREAM.
pub fn call(stream: u32, block: &[u8], message: &[u8]) -> Vec<u8> {
    let mut out = frame(HEADERS, 0x4, stream, block);
    out.extend(frame(DATA, END_STREAM, stream, &grpc_message(message)));
    out
}

/// `message` behind gRPC's 5-byte prefix (not compressed, its length).
pub fn grpc_message(message: &[u8]) -> Vec<u8> {
    let mut data = vec![0u8];
    data.extend((message.len() as u32).to_be_bytes());
    data.extend(message);
    data
}

impl RawH2 {
    /// Connects (TCP only: nothing is sent yet).
    pub fn connect(addr: SocketAddr) -> RawH2 {
        let stream = TcpStream::connect(addr).expect("connect to the request plane");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("read timeout");
        RawH2 { stream }
    }

    /// Connects from `source` (another loopback address, say): a caller at
    /// an address of its own.
    pub fn connect_from(source: std::net::IpAddr, addr: SocketAddr) -> RawH2 {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime");
        let stream = runtime.block_on(async {
            let socket = match source {
                std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
                std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
            }
            .expect("socket");
            socket
                .bind(SocketAddr::new(source, 0))
                .expect("bind the source");
            socket
                .connect(addr)
                .await
                .expect("connect to the request plane")
        });
        let stream = stream.into_std().expect("a std socket");
        stream.set_nonblocking(false).expect("blocking");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("read timeout");
        RawH2 { stream }
    }

    /// Sends the client preface and an empty SETTINGS frame.
    pub fn handshake(&mut self) {
        self.stream.write_all(&preface(&[])).expect("preface");
    }

    pub fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// The next frame; `Err` at the end of the stream or on a timeout.
    pub fn read_frame(&mut self) -> std::io::Result<Frame> {
        let mut head = [0u8; 9];
        self.stream.read_exact(&mut head)?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload)?;
        Ok(Frame {
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
            payload,
        })
    }

    /// Reads until the connection ends; every frame seen, and whether it
    /// ended (rather than timing out).
    pub fn read_to_end(&mut self) -> (Vec<Frame>, bool) {
        let mut frames = Vec::new();
        loop {
            match self.read_frame() {
                Ok(f) => frames.push(f),
                Err(e) => {
                    let ended = !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    );
                    return (frames, ended);
                }
            }
        }
    }
}

/// The HEADERS of a trtllm `Generate` call to `target`, for a test driving
/// the h2 crate's client by hand (its body is the test's to send).
pub fn generate_request_head(target: std::net::SocketAddr) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{target}/trtllm.TrtllmService/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request")
}

/// An HPACK block for a gRPC POST to `path` (static-table references and
/// literals without indexing: no dynamic table to keep in step).
pub fn grpc_headers_block(authority: &str, path: &str) -> Vec<u8> {
    let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
    for (prefix, value) in [
        (&[0x04u8][..], path),                   // :path
        (&[0x01u8][..], authority),              // :authority
        (&[0x0f, 0x10][..], "application/grpc"), // content-type (index 31)
    ] {
        block.extend_from_slice(prefix);
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block.extend_from_slice(&[0x00, 2]);
    block.extend_from_slice(b"te");
    block.push(8);
    block.extend_from_slice(b"trailers");
    block
}
