//! A TCP relay between the sidecar and the engine that can go silent: it stops
//! forwarding bytes in both directions without closing anything, as a
//! partitioned network or a stuck middlebox would. It can also cut every open
//! connection while the engine behind it runs on.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Relay {
    pub addr: SocketAddr,
    silent: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    /// Listens on a fresh loopback port and forwards every connection to `target`.
    pub fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("relay addr");
        let silent = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (silent.clone(), stop.clone());
        let open = Arc::new(Mutex::new(Vec::new()));
        let opened = open.clone();
        std::thread::spawn(move || {
            while !st.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((down, _)) => {
                        let _ = down.set_nonblocking(false);
                        let Ok(up) = TcpStream::connect(target) else {
                            continue;
                        };
                        if let Ok(mut o) = opened.lock() {
                            o.extend(down.try_clone());
                            o.extend(up.try_clone());
                        }
                        pump(&down, &up, s.clone(), st.clone());
                        pump(&up, &down, s.clone(), st.clone());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Relay {
            addr,
            silent,
            stop,
            open,
        }
    }

    /// Closes every connection opened so far (new ones are still relayed).
    pub fn cut(&self) {
        for stream in self.open.lock().expect("relay lock").drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Stops (true) or resumes (false) forwarding.
    pub fn set_silent(&self, silent: bool) {
        self.silent.store(silent, Ordering::Release);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn pump(from: &TcpStream, to: &TcpStream, silent: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    let (mut from, mut to) = (
        from.try_clone().expect("clone"),
        to.try_clone().expect("clone"),
    );
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            while silent.load(Ordering::Acquire) && !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // Bytes read just as the relay went silent are held, not passed.
            while silent.load(Ordering::Acquire) && !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            if stop.load(Ordering::Acquire) || to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}
