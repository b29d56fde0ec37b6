//! Which of the event channels in Dynamo's discovery this process publishes.
//!
//! Dynamo's `Worker` registers event channels (`kv_metrics`, the
//! `active_sequences_events` of its completion publisher) under publisher ids
//! drawn at random, not under the worker's instance id, and unregisters them
//! only when it drops the publishers: after its own grace period, drain and
//! cleanup, or at the process's exit. A worker that withdraws must remove them
//! itself, and must not touch another worker's. A direct-ZMQ channel names the
//! `tcp://host:port` its publisher listens on; it is this process's when that
//! host is an address of this machine and that port is one this process
//! listens on (Linux: `/proc/self/fd` and `/proc/self/net/tcp{,6}`). Ports are
//! unique within a machine's network namespace, so no other process's channel
//! matches both.

use std::collections::HashSet;
use std::net::{SocketAddr, UdpSocket};

/// The TCP ports this process listens on; empty where `/proc` cannot say.
pub fn listening_ports() -> HashSet<u16> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return HashSet::new();
    };
    let sockets: HashSet<u64> = fds
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| socket_inode(&target.to_string_lossy()))
        .collect();
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| listeners(&table))
        .filter(|(_, inode)| sockets.contains(inode))
        .map(|(port, _)| port)
        .collect()
}

/// `socket:[12345]` → 12345.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The (port, inode) of each listening socket in a `/proc/net/tcp` table:
/// `sl local_address rem_address st ... uid timeout inode`, the port in hex
/// after the local address's colon, state `0A` for LISTEN.
fn listeners(table: &str) -> Vec<(u16, u64)> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&"0A") {
                return None;
            }
            let port = fields.get(1)?.rsplit(':').next()?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let inode = fields.get(9)?.parse().ok()?;
            Some((port, inode))
        })
        .collect()
}

/// Whether a direct-ZMQ endpoint (`tcp://host:port`) is one of this
/// process's listeners: its port among `ports`, its host an address of this
/// machine (a UDP socket can be bound to it; nothing is sent).
pub fn is_ours(endpoint: &str, ports: &HashSet<u16>) -> bool {
    let Some(address) = endpoint
        .strip_prefix("tcp://")
        .and_then(|a| a.parse::<SocketAddr>().ok())
    else {
        return false;
    };
    ports.contains(&address.port()) && UdpSocket::bind((address.ip(), 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_this_process_listens_on_is_found_and_is_ours_on_a_local_address() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        let ports = listening_ports();
        assert!(ports.contains(&port), "{port} in {ports:?}");
        assert!(is_ours(&format!("tcp://127.0.0.1:{port}"), &ports));
        // Another machine's address with the same port is not ours.
        assert!(!is_ours(&format!("tcp://192.0.2.7:{port}"), &ports));
        drop(listener);
        assert!(!listening_ports().contains(&port));
        assert!(!is_ours("nats://x", &ports));
    }

    #[test]
    fn a_proc_table_yields_only_its_listeners() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
            0: 0100007F:B3E1 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0\n   \
            1: 0100007F:B3E2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0\n";
        assert_eq!(listeners(table), [(0xB3E1, 4242)]);
        assert_eq!(socket_inode("socket:[4242]"), Some(4242));
        assert_eq!(socket_inode("pipe:[1]"), None);
    }
}
