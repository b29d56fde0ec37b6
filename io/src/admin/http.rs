//! A minimal HTTP/1.1 server for small, read-mostly endpoints: the sidecar's
//! admin port and the mock engine's control port. Handlers are synchronous and
//! cheap; anything slow belongs in a task they signal.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One request, as handlers see it.
#[derive(Debug, Clone)]
pub struct Request {
    /// `GET`, `POST`, …
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query string's pairs, in order.
    pub query: Vec<(String, String)>,
    /// The `Accept` header (empty when there is none): `/metrics` answers in
    /// OpenMetrics when it asks for that.
    pub accept: String,
}

impl Request {
    /// The request for `method` and a request target (`/path?query`), the
    /// query split and percent-decoded. Never fails: odd input gives odd names.
    pub fn from_target(method: &str, target: &str) -> Request {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        Request {
            method: method.to_string(),
            path: path.to_string(),
            query: parse_query(query),
            accept: String::new(),
        }
    }

    /// The first value of a query parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One response.
#[derive(Debug, Clone)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// Content type.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl Response {
    /// `200` with a text body.
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    /// `200` with a JSON body.
    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Response {
            status,
            content_type: "application/json",
            body: body.into(),
        }
    }
}

/// What the server calls for each request.
pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(
                    std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or(""),
                    16,
                ) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Splits `a=1&b=two` into pairs, percent-decoded.
pub fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(pair), String::new()),
        })
        .collect()
}

/// A client has this long to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// One connection lives at most this long (a scraper's keep-alive included):
/// nobody can hold the admin port open for ever.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Connections served at once. The admin port is for a few probes and a
/// scraper; a newcomer past this closes the oldest connection rather than
/// being turned away (see [`Connections`]).
const MAX_CONNECTIONS: usize = 64;

/// Connections one peer address may hold at once; more from it are closed at
/// once. A kubelet probes one request at a time, a scraper keeps one or two.
const PER_PEER: usize = 8;

/// The connections being served, oldest first, and how many each peer holds.
///
/// Room for a probe, always: one peer cannot hold more than [`PER_PEER`], so
/// filling the port takes many addresses; and when it is full, a new
/// connection closes the oldest connection of the peer that holds the most,
/// instead of being refused. A flood of idle connections from a few addresses
/// then cycles through their own slots, and the kubelet's one connection is
/// not closed for them however fast they come.
#[derive(Default)]
struct Connections {
    next_id: u64,
    open: std::collections::BTreeMap<u64, (IpAddr, CancellationToken)>,
    per_peer: std::collections::HashMap<IpAddr, usize>,
}

impl Connections {
    /// Takes in a connection from `peer`: its id and the token that closes it,
    /// or `None` when the peer already holds its share.
    fn admit(
        &mut self,
        peer: IpAddr,
        cancel: &CancellationToken,
    ) -> Option<(u64, CancellationToken)> {
        let held = self.per_peer.entry(peer).or_default();
        if *held >= PER_PEER {
            return None;
        }
        *held += 1;
        if self.open.len() >= MAX_CONNECTIONS {
            self.close_one();
        }
        let id = self.next_id;
        self.next_id += 1;
        let close = cancel.child_token();
        self.open.insert(id, (peer, close.clone()));
        Some((id, close))
    }

    /// Makes room: closes the oldest connection of the peer holding the most.
    fn close_one(&mut self) {
        let Some(busiest) = self
            .per_peer
            .iter()
            .max_by_key(|(_, held)| **held)
            .map(|(peer, _)| *peer)
        else {
            return;
        };
        let oldest = self
            .open
            .iter()
            .find(|(_, (peer, _))| *peer == busiest)
            .map(|(id, _)| *id);
        if let Some((peer, close)) = oldest.and_then(|id| self.open.remove(&id)) {
            close.cancel();
            self.leave(peer);
        }
    }

    /// A connection ended (or was closed to make room: then already gone).
    fn end(&mut self, id: u64) {
        if let Some((peer, _)) = self.open.remove(&id) {
            self.leave(peer);
        }
    }

    fn leave(&mut self, peer: IpAddr) {
        if let Some(held) = self.per_peer.get_mut(&peer) {
            *held -= 1;
            if *held == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }
}

/// The books, even after a panic elsewhere left them as they were (usable).
fn lock(c: &std::sync::Mutex<Connections>) -> std::sync::MutexGuard<'_, Connections> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves `handler` on `listener` until `cancel` fires.
pub async fn serve(listener: TcpListener, handler: Handler, cancel: CancellationToken) {
    let connections = Arc::new(std::sync::Mutex::new(Connections::default()));
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, peer)) = accepted else {
            continue;
        };
        let Some((id, close)) = lock(&connections).admit(peer.ip(), &cancel) else {
            drop(stream);
            continue;
        };
        let handler = handler.clone();
        let connections = connections.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
                let mut request = Request::from_target(req.method().as_str(), target);
                if let Some(accept) = req.headers().get(hyper::header::ACCEPT) {
                    request.accept = String::from_utf8_lossy(accept.as_bytes()).into_owned();
                }
                let response = handler(&request);
                async move {
                    let built = hyper::Response::builder()
                        .status(response.status)
                        .header("content-type", response.content_type)
                        .body(Full::new(Bytes::from(response.body)));
                    Ok::<_, Infallible>(built.unwrap_or_else(|_| {
                        hyper::Response::new(Full::new(Bytes::from_static(b"internal error")))
                    }))
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(16 * 1024)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                () = close.cancelled() => {}
                _ = tokio::time::timeout(CONNECTION_LIFETIME, conn) => {}
            }
            lock(&connections).end(id);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_port_closes_the_busiest_peers_oldest_connection_and_a_peer_holds_at_most_its_share() {
        let root = CancellationToken::new();
        let mut books = Connections::default();
        let ip = |n: u8| IpAddr::from([127, 0, 0, n]);
        // One busy peer with its share, then one connection each from others
        // (the kubelet among them: 127.0.0.2) until the port is full.
        let mut busy = Vec::new();
        for _ in 0..PER_PEER {
            busy.push(books.admit(ip(1), &root).expect("within its share"));
        }
        assert!(
            books.admit(ip(1), &root).is_none(),
            "127.0.0.1 holds its share"
        );
        let kubelet = books.admit(ip(2), &root).expect("the kubelet");
        for n in 0..(MAX_CONNECTIONS - PER_PEER - 1) {
            assert!(books.admit(ip(3 + n as u8), &root).is_some(), "peer {n}");
        }
        assert_eq!(books.open.len(), MAX_CONNECTIONS);
        let newcomer = books.admit(ip(250), &root).expect("room is made");
        assert!(
            busy[0].1.is_cancelled(),
            "the busiest peer's oldest was closed"
        );
        assert!(busy[1..].iter().all(|(_, close)| !close.is_cancelled()));
        assert!(
            !kubelet.1.is_cancelled(),
            "a peer with one connection is not closed"
        );
        assert_eq!(books.open.len(), MAX_CONNECTIONS);
        books.end(busy[0].0);
        assert_eq!(
            books.open.len(),
            MAX_CONNECTIONS,
            "its end was already booked"
        );
        assert!(
            books.admit(ip(1), &root).is_some(),
            "127.0.0.1 has room again"
        );
        books.end(newcomer.0);
        assert_eq!(books.per_peer.get(&ip(250)), None);
    }

    #[test]
    fn queries_decode() {
        assert_eq!(
            parse_query("status=2&text=not%20ok&x"),
            vec![
                ("status".to_string(), "2".to_string()),
                ("text".to_string(), "not ok".to_string()),
                ("x".to_string(), String::new())
            ]
        );
        assert_eq!(
            parse_query("a=%zz&b=%4"),
            vec![("a".into(), "%zz".into()), ("b".into(), "%4".into())]
        );
    }
}
