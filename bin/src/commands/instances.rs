//! `llm-sidecar instances`: what discovery holds, as a table or JSON.

use std::time::Duration;

use clap::Args;
use llm_sidecar_io::discovery::{DiscoveryUri, EtcdDiscovery, FileDiscovery, ListRecords, Listed};
use llm_sidecar_io::report::error_chain;

use crate::runtime::runtime;
use crate::shared::{EtcdTlsArgs, Exit};

/// Flags of `llm-sidecar instances`.
#[derive(Debug, Args)]
pub struct InstancesArgs {
    /// Where to look: file:<dir> or etcd://host:port[,...].
    // The doc comment is --help text, where `<dir>` reads as it should.
    #[allow(rustdoc::invalid_html_tags)]
    #[arg(
        long,
        env = "SIDECAR_DISCOVERY",
        default_value = "file:.llm-sidecar/discovery"
    )]
    pub discovery: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub etcd_tls: EtcdTlsArgs,
}

/// `llm-sidecar instances`.
pub fn run(args: InstancesArgs) -> Exit {
    let uri = match DiscoveryUri::parse(&args.discovery) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Usage;
        }
    };
    let etcd_tls = match args.etcd_tls.load() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return Exit::Usage;
        }
    };
    let listed = match &uri {
        DiscoveryUri::File(dir) => {
            // Listing registers nothing, so the guard interval is never used.
            runtime(None).block_on(FileDiscovery::new(dir.clone(), Duration::from_secs(1)).list())
        }
        DiscoveryUri::Etcd(endpoints) => runtime(None).block_on(async {
            let bound = Duration::from_secs(5);
            EtcdDiscovery::new(
                endpoints.clone(),
                Duration::from_secs(10),
                bound,
                etcd_tls.as_ref(),
            )?
            .list()
            .await
        }),
        DiscoveryUri::Kubernetes { .. } => {
            eprintln!(
                "error: {uri}: Dynamo's workers in Kubernetes are listed with \
                 `kubectl get dynamoworkermetadatas`"
            );
            return Exit::Usage;
        }
    };
    let listed = match listed {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot read {uri}: {}", error_chain(&e));
            return Exit::Own(1);
        }
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&listed).unwrap_or_else(|_| "[]".into())
        );
        return Exit::SUCCESS;
    }
    if listed.is_empty() {
        outln!("no instances registered in {uri}");
        return Exit::SUCCESS;
    }
    outln!(
        "{:<18} {:<10} {:<22} {:<8} {:<28} {:<8} REGISTERED",
        "INSTANCE",
        "ENGINE",
        "ADDRESS",
        "PID",
        "MODEL",
        "VERSION"
    );
    for entry in &listed {
        match &entry.content {
            Listed::Record(r) => outln!(
                "{:<18} {:<10} {:<22} {:<8} {:<28} {:<8} {}",
                shown(&r.instance_id),
                shown(&r.engine.kind),
                shown(&r.address),
                r.pid,
                shown(&r.model.name),
                shown(&r.engine.version),
                shown(&r.registered_at)
            ),
            Listed::Invalid { error } => outln!(
                "{:<18} invalid record at {}: {}",
                "-",
                shown(&entry.key),
                shown(error)
            ),
        }
    }
    Exit::SUCCESS
}

/// A value from a record as the table shows it: control characters (a
/// newline, an escape sequence) escaped, so a record cannot forge rows or
/// repaint the terminal.
fn shown(value: &str) -> String {
    value
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(shown("a\nb\u{1b}[2J"), "a\\nb\\u{1b}[2J");
        assert_eq!(shown("model-7b"), "model-7b");
    }
}
